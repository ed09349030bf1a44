"""The live counts kept in single rows (tasks/counters.py): whatever writes the task table, the
rows agree with a count of it — on SQLite and on PostgreSQL, with writers racing."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks import counters, lifecycle
from tasks.models import FileVersion, LaneTenantLoad, Task
from tasks.services.tenancy import tenant_ensure
from tasks.states import State

pytestmark = pytest.mark.django_db(transaction=True)
S = State


def new_task(tenant, *, lane: str = "batch", index: int = 0) -> Task:
    now = timezone.now()
    file = FileVersion.objects.create(tenant=tenant, sha256=f"{index:064x}", size=10, detected_type="audio/x-wav",
                                      storage_name=f"x/{index}")
    return Task.objects.create(tenant=tenant, file=file, kind="transcription", target_format="txt", lane_id=lane,
                               deadline_at=now, queue_deadline_at=now)


def agree() -> None:
    assert counters.counts_check(repair=False, quiet=True) == 0, (
        list(LaneTenantLoad.objects.values()), counters._live_counts())


def test_admission_reads_the_lane_with_its_counts_in_one_statement():
    acme, globex = tenant_ensure(name="acme"), tenant_ensure(name="globex")
    for index in range(2):
        new_task(acme, index=index)
    new_task(globex, index=5)
    lane, counts = counters.lane_with_counts_by_tenant("batch")
    assert lane.name == "batch" and lane.max_running > 0
    assert counts == counters.lane_counts_by_tenant("batch") and counts[acme.pk]["accepted"] == 2
    assert set(counts) == {acme.pk, globex.pk}
    empty, none = counters.lane_with_counts_by_tenant("interactive")
    assert empty.name == "interactive" and none == {}
    assert counters.lane_with_counts_by_tenant("no-such-lane") == (None, {})


def test_admission_reads_the_lane_its_counts_and_every_channels_room_in_one_statement():
    """channels.rooms_with_lane: what lane_with_counts_by_tenant and channel_rooms read apart,
    field for field, in one statement; the lane alone when no channel is enabled."""
    from django.test.utils import CaptureQueriesContext

    from tasks.models import Lane, VendorChannel
    from tasks.scheduling.channels import channel_rooms, rooms_with_lane

    acme, globex = tenant_ensure(name="acme"), tenant_ensure(name="globex")
    for index in range(2):
        new_task(acme, index=index)
    new_task(globex, index=5)
    Lane.objects.filter(pk="batch").update(paused=True, aging_s=12.5, queue_deadline_s=600)
    assert VendorChannel.objects.filter(enabled=True).exists()
    with CaptureQueriesContext(connection) as statements:
        rooms, lane, counts = rooms_with_lane("batch")
    assert len(statements.captured_queries) == 1
    orm = Lane.objects.get(pk="batch")
    fields = [f.attname for f in Lane._meta.concrete_fields]
    assert [getattr(lane, name) for name in fields] == [getattr(orm, name) for name in fields]
    assert lane.paused is True and isinstance(lane.queue_deadline_s, float) and lane.updated_at.tzinfo is not None
    assert counts == counters.lane_with_counts_by_tenant("batch")[1] and counts[acme.pk]["accepted"] == 2

    def described(found):
        return {name: (r.available, r.free_jobs, r.free_uploads, r.trials_left, r.free_by_row) for name, r in found.items()}

    assert described(rooms) == described(channel_rooms()) and rooms
    assert rooms_with_lane("no-such-lane")[1:] == (None, {})
    VendorChannel.objects.update(enabled=False)
    rooms, lane, counts = rooms_with_lane("batch")
    assert rooms == {} and lane.name == "batch" and counts[globex.pk]["accepted"] == 1


def test_every_kind_of_write_moves_the_counts():
    acme, globex = tenant_ensure(name="acme"), tenant_ensure(name="globex")
    tasks = [new_task(acme, index=i) for i in range(3)] + [new_task(globex, lane="interactive", index=9)]
    agree()
    assert counters.lane_counts("batch")["accepted"] == 3
    first = tasks[0]
    # A transition (the one state writer), with a lane change on the way, as a pre-check does.
    lifecycle.transition(first.pk, source=S.ACCEPTED, target=S.QUEUED, generation=0, actor="t", reason="r",
                         fields={"lane_id": "interactive"})
    agree()
    assert counters.lane_counts("interactive")["queued"] == 1 and counters.lane_counts("batch")["accepted"] == 2
    # A non-state column that moves a task between stages (admission dispatches it).
    lifecycle.task_update(first.pk, state=S.QUEUED, generation=1, dispatched_at=timezone.now())
    agree()
    assert counters.lane_counts_by_tenant("interactive")[acme.pk]["dispatched"] == 1
    lifecycle.transition(first.pk, source=S.QUEUED, target=S.RUNNING, generation=1, actor="t", reason="r")
    lifecycle.transition(first.pk, source=S.RUNNING, target=S.RETRY_WAIT, generation=2, actor="t", reason="r")
    agree()
    assert counters.tenant_counts(acme.pk)["retry_wait"] == 1
    lifecycle.transition(first.pk, source=S.RETRY_WAIT, target=S.QUEUED, generation=3, actor="t", reason="r")
    lifecycle.transition(first.pk, source=S.QUEUED, target=S.CANCELLED, generation=4, actor="t", reason="r")
    agree()
    # A bulk update of many rows at once (an operator's bulk action, a test's shortcut).
    Task.objects.filter(tenant=acme, state=S.ACCEPTED).update(state=S.QUEUED)
    agree()
    # A tenant moved (never done, but no write escapes the counts), and deletes (retention).
    Task.objects.filter(pk=tasks[1].pk).update(tenant=globex)
    agree()
    Task.objects.filter(pk__in=[tasks[2].pk, tasks[3].pk]).delete()
    agree()
    assert counters.lane_counts("batch") == dict.fromkeys(counters.STAGES, 0) | {"queued": 1}


def test_writers_racing_on_one_lane_leave_it_exact():
    """Eight writers move forty tasks of one lane through their stages at once, each in its own
    transactions (PostgreSQL: the counter row is written when each commits)."""
    tenant = tenant_ensure(name="acme")
    tasks = [new_task(tenant, index=i) for i in range(40)]
    errors: list[BaseException] = []

    def walk(mine: list[Task]) -> None:
        try:
            for task in mine:
                with transaction.atomic():
                    lifecycle.transition(task.pk, source=S.ACCEPTED, target=S.QUEUED, generation=0, actor="t", reason="r")
                lifecycle.task_update(task.pk, state=S.QUEUED, generation=1, dispatched_at=timezone.now())
                lifecycle.transition(task.pk, source=S.QUEUED, target=S.RUNNING, generation=1, actor="t", reason="r")
                if task.pk.int % 2:
                    lifecycle.transition(task.pk, source=S.RUNNING, target=S.SUCCEEDED, generation=2, actor="t",
                                         reason="r")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=walk, args=(tasks[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:2]
    agree()
    running = sum(1 for t in tasks if not t.pk.int % 2)
    assert counters.lane_counts("batch") == dict.fromkeys(counters.STAGES, 0) | {"in_flight": running}


def test_a_wrong_row_is_found_logged_and_repaired():
    tenant = tenant_ensure(name="acme")
    new_task(tenant)
    LaneTenantLoad.objects.filter(lane="batch").update(accepted=7)  # a write the triggers never saw
    assert counters.counts_check(repair=True, quiet=True) == 1
    agree()
    assert counters.lane_counts("batch")["accepted"] == 1
