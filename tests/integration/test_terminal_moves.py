"""A terminal move says in its own statement what the task leaves behind: whether the outbox has
anything to write (a callback URL, the task's or its tenant's, or an older event still pending),
whether the task has more than one vendor job (its billing check), whether any lane holds tasks
waiting for admission (the slots it frees), whether it still holds budget slots. A task with
none of them reads and writes nothing more; one with any gets what it had before."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks import counters, workers
from tasks.lifecycle import task_update
from tasks.models import (
    Attempt,
    BudgetSlot,
    DuplicateIncident,
    Lane,
    Notification,
    Task,
    TaskEvent,
    VendorCall,
    VendorChannel,
    VendorJob,
)
from tasks.poc import files
from tasks.scheduling.budgets import slots_reserve
from tasks.services import intake
from tasks.services.execution.jobs import record_job
from tasks.services.execution.start import _job_created
from tasks.services.outcomes import LeftBehind, task_move
from tasks.states import State
from tasks.vendors.protocol import Created, JobView
from tests.conftest import CHANNEL_DEFAULTS
from tests.support.flows import stored_task, submit_file

NOTHING = LeftBehind(outbox=False, several_jobs=False, lanes_waiting=False, slots_open=False)


def _fail(task: Task):
    return task_move(task.pk, source=State.ACCEPTED, target=State.FAILED, generation=task.generation, actor="test",
                     reason="refused", fields=dict(error_code="refused"))


def test_a_terminal_move_of_a_task_nobody_listens_to_reads_nothing_after_it(tenant):
    task = stored_task(tenant)
    with CaptureQueriesContext(connection) as statements:
        moved = _fail(task)
    assert LeftBehind.of(moved) == NOTHING
    assert not [q["sql"] for q in statements.captured_queries if q["sql"].lstrip().upper().startswith("SELECT")]
    assert Task.objects.get(pk=task.pk).state == State.FAILED
    assert TaskEvent.objects.filter(task=task, to_state=State.FAILED).count() == 1
    assert not Notification.objects.filter(task=task).exists()


def test_a_terminal_move_writes_the_notification_of_a_task_or_tenant_with_a_callback(tenant):
    listened = stored_task(tenant, callback_url="https://hooks.example.com/task")
    assert LeftBehind.of(_fail(listened)).outbox
    tenant.callback_url = "https://hooks.example.com/tenant"
    tenant.save()
    by_tenant = stored_task(tenant)
    assert LeftBehind.of(_fail(by_tenant)).outbox
    sent = {n.task_id: (n.url, n.event_type, n.status) for n in Notification.objects.all()}
    assert sent == {listened.pk: ("https://hooks.example.com/task", "task.failed", Notification.Status.PENDING),
                    by_tenant.pk: ("https://hooks.example.com/tenant", "task.failed", Notification.Status.PENDING)}


def test_an_older_event_still_pending_is_superseded_though_nobody_listens_any_more(tenant):
    # A dead letter replayed after its failure was announced: the URL has since been removed.
    task = stored_task(tenant)
    older = Notification.objects.create(task=task, generation=task.generation, tenant=tenant,
                                        url="https://hooks.example.com/gone", event_type="task.failed", payload={},
                                        next_attempt_at=timezone.now())
    Task.objects.filter(pk=task.pk).update(generation=task.generation + 1)
    task.refresh_from_db()
    assert LeftBehind.of(_fail(task)).outbox
    older.refresh_from_db()
    assert older.status == Notification.Status.SUPERSEDED
    assert Notification.objects.filter(task=task).count() == 1


def _job(task: Task, n: int) -> VendorJob:
    return VendorJob.objects.create(channel=VendorChannel.objects.get(name="primary"), task=task,
                                    vendor_job_id=f"job-{task.pk}-{n}", client_ref=f"{task.pk}-{n}")


def test_a_terminal_move_says_whether_the_task_has_more_than_one_vendor_job(tenant):
    one, two = stored_task(tenant), stored_task(tenant)
    _job(one, 1)
    _job(two, 1), _job(two, 2)
    assert LeftBehind.of(_fail(one)) == NOTHING
    assert LeftBehind.of(_fail(two)) == LeftBehind(outbox=False, several_jobs=True, lanes_waiting=False,
                                                          slots_open=False)


def test_a_task_that_ends_with_a_second_job_never_checked_gets_its_incident_as_it_ends(tenant):
    # A step that died between recording a job and its billing check; the task then fails.
    task = stored_task(tenant)
    kept = _job(task, 1)
    Task.objects.filter(pk=task.pk).update(vendor_job=kept)
    VendorJob.objects.filter(pk=_job(task, 2).pk).update(amount_cents=5)
    assert not DuplicateIncident.objects.filter(task=task).exists()
    assert LeftBehind.of(_fail(task)).several_jobs
    incident = DuplicateIncident.objects.get(task=task)
    assert (incident.kept_job_id, incident.duplicate_job_ids) == (kept.vendor_job_id, [f"job-{task.pk}-2"])
    assert incident.duplicate_amount_cents == 5


def test_a_terminal_move_says_whether_a_lane_holds_tasks_waiting_for_admission(transactional_db, tenant):
    # Committed, not in a test's transaction: PostgreSQL's counters move when the writer commits.
    waiting = stored_task(tenant, lane_id="batch", state=State.QUEUED)
    admitted = stored_task(tenant, lane_id="batch", state=State.QUEUED, dispatched_at=timezone.now())
    assert LeftBehind.of(_fail(stored_task(tenant))).lanes_waiting
    Task.objects.filter(pk=waiting.pk).update(dispatched_at=timezone.now())
    assert LeftBehind.of(_fail(stored_task(tenant))) == NOTHING, "a task admitted and not yet started waits for no slot"
    Task.objects.filter(pk=admitted.pk).update(lane_id="interactive", dispatched_at=None)
    assert LeftBehind.of(_fail(stored_task(tenant))).lanes_waiting, "any lane's waiting task counts"


def _open_slots(task: Task) -> int:
    return BudgetSlot.objects.filter(task=task, released_at__isnull=True).count()


def test_a_running_task_that_ends_holding_slots_releases_them(tenant):
    # A create the vendor refused: the job slot is still held when the task fails.
    channel = VendorChannel.objects.get(name="primary")
    task = stored_task(tenant, state=State.RUNNING, channel=channel)
    slots_reserve(task, channel)
    moved = task_move(task.pk, source=State.RUNNING, target=State.FAILED, generation=task.generation, actor="test",
                      reason="refused", fields=dict(error_code="refused"))
    assert LeftBehind.of(moved).slots_open
    assert _open_slots(task) == 0


def test_slots_reserved_while_a_queued_task_is_cancelled_are_released_with_it(transactional_db, tenant):
    """The dispatcher admits a queued task (its row updated, its slots inserted) while a cancel of
    it waits for the row: the cancel then moves it (it is still QUEUED at its generation), but on
    PostgreSQL its statement read the slots from before they committed. A move from a state slots
    are reserved in releases them whatever it read. Real threads, each with its own connection."""
    channel = VendorChannel.objects.get(name="primary")
    for _ in range(3):
        task = stored_task(tenant, state=State.QUEUED, lane_id="batch")
        reserved = threading.Event()

        def admit() -> None:
            try:
                with transaction.atomic():
                    assert task_update(task.pk, state=State.QUEUED, generation=task.generation,
                                       channel=channel, dispatched_at=timezone.now())
                    slots_reserve(task, channel)
                    reserved.set()
                    time.sleep(0.3)  # the cancel's statement starts meanwhile and waits for the row
            finally:
                reserved.set()
                connection.close()

        moved: list = []

        def cancel() -> None:
            try:
                reserved.wait(timeout=10)
                moved.append(task_move(task.pk, source=State.QUEUED, target=State.CANCELLED, generation=task.generation,
                                       actor="test", reason="cancelled"))
            finally:
                connection.close()

        threads = [threading.Thread(target=admit), threading.Thread(target=cancel)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert moved and moved[0] is not None, "the cancel did not move the task"
        assert BudgetSlot.objects.filter(task=task).count() == 2
        assert _open_slots(task) == 0, "the cancelled task still holds the slots reserved while it waited"


# --- at the end of a worker's step ---------------------------------------------------------------
def _at_once(vendor) -> None:
    """The vendor answers the create with the job completed: the start step fetches it and ends the task."""
    vendor.control.channel("primary", **{**CHANNEL_DEFAULTS, "processing_ms": 0, "queue_ms": 0})
    VendorChannel.objects.filter(name="fallback").update(enabled=False)


def _billing_checks(statements) -> list[str]:
    return [q["sql"] for q in statements.captured_queries
            if VendorJob._meta.db_table in q["sql"] and "ORDER BY t.created_at, t.id" in q["sql"]]


def _lanes_read(statements) -> list[str]:
    """The reads of which lanes hold waiting tasks (dispatch.lanes_with_waiting_work), not the moves that ask it."""
    return [q["sql"] for q in statements.captured_queries
            if q["sql"].lstrip().upper().startswith("SELECT") and counters.LANES_WITH_QUEUED in q["sql"]]


def _writing(statements, model) -> list[str]:
    """The statements that UPDATE `model`'s rows, alone or beside a task's move (a WITH)."""
    return [q["sql"] for q in statements.captured_queries if f'UPDATE "{model._meta.db_table}"' in q["sql"]]


def test_a_task_that_succeeds_with_one_job_while_no_lane_waits_reads_neither_its_jobs_nor_the_lanes(
        vendor, api, monkeypatch):
    _at_once(vendor)
    monkeypatch.setenv("Q_CLUSTER_NAME", "interactive")  # this worker runs the lane: it starts the task itself
    task = Task.objects.get(pk=submit_file(api, priority="interactive"))
    with CaptureQueriesContext(connection) as statements:
        assert workers.run_step("precheck", str(task.pk), task.generation) == "succeeded"
    assert not _billing_checks(statements), "the task's jobs were read for a billing check though it has one"
    assert not _lanes_read(statements), "the lanes were read though none held a task waiting"
    # Its two slots were released as its upload ended and its job was bound: nothing is left to
    # release. Each write (and the slots and attempt its admission wrote, and the step's vendor
    # calls, written with its last move) is part of the statement of the task's move or update it
    # goes with, not a statement of its own: on PostgreSQL a part of its WITH, on SQLite carried in
    # its note, which the trigger writes.
    assert BudgetSlot.objects.filter(task=task).count() == 2 and _open_slots(task) == 0
    slot_writes, attempt_writes = _writing(statements, BudgetSlot), _writing(statements, Attempt)
    inserts = [q["sql"] for q in statements.captured_queries
               if any(f'INSERT INTO "{model._meta.db_table}"' in q["sql"] for model in (BudgetSlot, Attempt))]
    logged = [q["sql"] for q in statements.captured_queries if f'INSERT INTO "{VendorCall._meta.db_table}"' in q["sql"]]
    if connection.vendor == "postgresql":
        assert (len(slot_writes), len(attempt_writes), len(inserts), len(logged)) == (2, 1, 1, 1)
        for sql in (*slot_writes, *attempt_writes, *inserts, *logged):
            assert sql.lstrip().startswith("WITH moved AS (UPDATE"), sql
    else:
        assert slot_writes == attempt_writes == inserts == logged == []
    assert VendorCall.objects.filter(task=task).count() >= 3  # upload, create, result at least
    attempt = Attempt.objects.get(task=task)
    job = VendorJob.objects.get(task=task)
    assert (attempt.outcome, attempt.vendor_job_id) == (Attempt.Outcome.SUCCEEDED, job.vendor_job_id)
    assert attempt.upload_ms is not None and attempt.ended_at is not None
    assert vendor.control.invariants()["billed_jobs"] == 1


def test_a_job_created_finished_whose_download_fails_has_its_attempt_noted_all_the_same(vendor, api, monkeypatch):
    _at_once(vendor)
    vendor.control.add_rule({"endpoint": "GET /v1/jobs/*/result", "type": "http_error", "params": {"status": 503},
                             "times": 1})
    monkeypatch.setenv("Q_CLUSTER_NAME", "interactive")
    task = Task.objects.get(pk=submit_file(api, priority="interactive"))
    assert workers.run_step("precheck", str(task.pk), task.generation) == "started"
    task.refresh_from_db()
    assert task.state == State.RUNNING and task.phase == Task.Phase.FETCH
    attempt = Attempt.objects.get(task=task)
    assert attempt.vendor_job_id == task.vendor_job.vendor_job_id and attempt.upload_ms is not None
    assert attempt.ended_at is None, "the attempt goes on with the download's retry"


def test_the_slots_a_finished_task_leaves_go_at_once_to_the_task_waiting_for_them(vendor, api):
    _at_once(vendor)
    Lane.objects.filter(name="interactive").update(max_running=1)
    first = Task.objects.get(pk=submit_file(api, priority="interactive"))
    second = Task.objects.get(pk=submit_file(api, files.with_marker(files.wav(1), b"second"), priority="interactive"))
    assert intake.task_precheck_and_route(first.pk, first.generation) == "queued"
    first.refresh_from_db()
    assert first.dispatched_at is not None, "the first task was not admitted as it arrived"
    assert intake.task_precheck_and_route(second.pk, second.generation) == "queued"
    assert Task.objects.get(pk=second.pk).dispatched_at is None, "the lane's one slot was not held"
    with CaptureQueriesContext(connection) as statements:
        assert workers.run_step("start", str(first.pk), first.generation) == "succeeded"
    assert _lanes_read(statements), "the first task's move heard a task waiting: the lanes are offered its slots"
    assert Task.objects.get(pk=second.pk).dispatched_at is not None, "the waiting task was not admitted at once"


def test_a_second_job_of_a_task_is_reported_as_it_is_created_naming_the_job_the_task_keeps(vendor, api, monkeypatch):
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    monkeypatch.setenv("Q_CLUSTER_NAME", "interactive")
    task = Task.objects.get(pk=submit_file(api, priority="interactive"))
    earlier = VendorJob.objects.create(channel_id="primary", task=task, vendor_job_id="job-earlier", client_ref="earlier",
                                       status="failed", amount_cents=7, terminal_at=timezone.now())
    assert workers.run_step("precheck", str(task.pk), task.generation) == "started"
    task.refresh_from_db()
    assert task.state == State.RUNNING and task.vendor_job_id not in (None, earlier.pk)
    incident = DuplicateIncident.objects.get(task=task)  # at once, not when the task ends
    assert incident.kept_job_id == task.vendor_job.vendor_job_id
    assert incident.duplicate_job_ids == ["job-earlier"] and incident.duplicate_amount_cents == 7


def test_two_jobs_recorded_at_once_for_a_task_are_always_reported(vendor, tenant):
    """A job the start step creates (checked after its binding, which says whether there is a
    second) and one another path records at the same time (reconciliation adopting it, checked
    after its INSERT): whichever order their statements interleave in, one of the two sees both
    jobs and the task has its incident. Real threads, each with its own connection."""
    channel = VendorChannel.objects.get(name="primary")
    barrier = threading.Barrier(2)

    def created_by_the_start_step(task: Task) -> None:
        try:
            barrier.wait(timeout=10)
            _job_created(task, Created(JobView(id=f"job-{task.pk}-created", status="queued", amount_cents=3)))
        finally:
            connection.close()

    def adopted_by_another_path(task: Task) -> None:
        try:
            barrier.wait(timeout=10)
            record_job(task, channel, JobView(id=f"job-{task.pk}-adopted", status="queued", amount_cents=4), adopted=True)
        finally:
            connection.close()

    for _ in range(10):
        task = stored_task(tenant, state=State.RUNNING, channel=channel)
        task.channel = channel
        threads = [threading.Thread(target=created_by_the_start_step, args=(task,)),
                   threading.Thread(target=adopted_by_another_path, args=(task,))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert VendorJob.objects.filter(task=task).count() == 2
        incident = DuplicateIncident.objects.get(task=task)
        # Which one it keeps may still be settling (the task's end checks again); both are named.
        assert sorted([incident.kept_job_id, *incident.duplicate_job_ids]) == [f"job-{task.pk}-adopted",
                                                                               f"job-{task.pk}-created"]


def test_the_calls_a_last_move_was_to_write_are_written_later_when_it_fails(transactional_db):
    """The vendor calls not yet written ride on a task's last move; a move whose statement fails
    leaves them to be written by the step's end, as they were before it."""
    from tasks.rows import new_row
    from tasks.services.tenancy import tenant_ensure
    from tasks.vendors import http

    task = stored_task(tenant_ensure(name="acme"))
    channel = VendorChannel.objects.order_by("name").first()
    http.log_calls([new_row(VendorCall, channel=channel, task=task, generation=0, operation="create", outcome="ok")])
    failing = dict(error_code=None)  # NOT NULL: the move's statement fails
    with pytest.raises(IntegrityError):
        task_move(task.pk, source=State.ACCEPTED, target=State.FAILED, generation=0, actor="test", reason="x",
                  fields=failing)
    assert not VendorCall.objects.filter(task=task).exists()
    http.flush_calls()
    assert VendorCall.objects.filter(task=task).count() == 1
    http.log_calls([new_row(VendorCall, channel=channel, task=task, generation=0, operation="result", outcome="ok")])
    assert _fail(task) is not None
    assert VendorCall.objects.filter(task=task).count() == 2, "the call rode on the move"
    assert not http.take_calls()
    # Calls whose INSERT was rolled back are written again as new rows (the key they were given
    # went back with the rollback, and SQLite gives it to the next row).
    call = new_row(VendorCall, channel=channel, task=task, generation=0, operation="poll", outcome="ok")
    with pytest.raises(RuntimeError), transaction.atomic():
        http.log_calls([call])
        taken = http.take_calls()
        from tasks.rows import insert_rows

        insert_rows(taken)
        assert call.pk is not None
        raise RuntimeError("the move's transaction fails after the calls were written")
    http.put_back_calls(taken)
    VendorCall.objects.create(channel=channel, task=task, generation=0, operation="poll", outcome="ok")
    http.flush_calls()
    assert VendorCall.objects.filter(task=task).count() == 4
