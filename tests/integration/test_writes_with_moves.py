"""Writes that go with a task's move (`tasks.rows.Write`, `lifecycle.transition(writes=…)` and its
kin): made only if the task moved, or whatever came of the move when asked so; on PostgreSQL in
the move's own statement, on SQLite in it too when its trigger makes them (an admission's slots
and attempt, an attempt's end, a slot's release, vendor calls: `lifecycle.NOTED_INSERTS` and
`NOTED_CHANGES`), else after it in its transaction. Both databases."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from tasks import lifecycle
from tasks.models import Attempt, BudgetSlot, Task, TaskEvent, VendorCall, VendorChannel
from tasks.rows import Write, new_row
from tasks.states import State
from tests.support.flows import stored_task


def _note(task: Task, reason: str, *, if_moved: bool = True) -> Write:
    return Write.insert([new_row(TaskEvent, task_id=task.pk, generation=task.generation, actor="test", reason=reason)],
                        if_moved=if_moved)


def _renamed(task: Task, reason: str, to: str) -> Write:
    return Write.change(TaskEvent, {"reason": to}, {"task": task.pk, "reason": reason})


def _reasons(task: Task) -> set[str]:
    return set(TaskEvent.objects.filter(task=task).values_list("reason", flat=True))


def _queue(task: Task, generation: int, writes: tuple[Write, ...]):
    return lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=generation,
                                actor="test", reason="queued", writes=writes)


def test_a_moves_writes_are_made_when_it_moved_and_only_those_asked_for_when_it_did_not(tenant):
    task = stored_task(tenant)
    TaskEvent.objects.create(task=task, generation=0, actor="test", reason="before")
    stale = _queue(task, task.generation + 5, (_note(task, "if moved"), _note(task, "anyway", if_moved=False),
                                               _renamed(task, "before", "renamed while stale")))
    assert stale is None
    assert _reasons(task) == {"before", "anyway"}
    moved = _queue(task, task.generation, (_note(task, "if moved"), _renamed(task, "before", "renamed")))
    assert moved is not None and moved.generation == 1
    assert _reasons(task) == {"renamed", "anyway", "if moved", "queued"}


def test_an_updates_writes_follow_its_compare_and_set(tenant):
    task = stored_task(tenant)
    assert not lifecycle.task_update(task.pk, state=State.QUEUED, generation=0, waiting_reason="x",
                                     writes=(_note(task, "if updated"), _note(task, "anyway", if_moved=False)))
    assert _reasons(task) == {"anyway"}
    assert lifecycle.task_update(task.pk, state=State.ACCEPTED, generation=0, waiting_reason="x",
                                 writes=(_note(task, "if updated"),))
    assert _reasons(task) == {"anyway", "if updated"}
    recorded = lifecycle.task_update_recorded(task.pk, state=State.ACCEPTED, generation=0, actor="test",
                                              reason="found", waiting_reason="y", writes=(_note(task, "with it"),))
    assert recorded is not None and _reasons(task) == {"anyway", "if updated", "found", "with it"}


def test_on_postgresql_a_moves_writes_are_in_its_statement_and_fail_with_it(tenant):
    task = stored_task(tenant)
    with CaptureQueriesContext(connection) as statements:
        moved = _queue(task, 0, (_note(task, "one"), _note(task, "two")))
    assert moved is not None
    written = [q["sql"] for q in statements.captured_queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE", "BEGIN"))]
    if connection.vendor == "postgresql":
        assert len(written) == 1, written  # the move, its history entry and both writes
    else:
        assert len(written) == 3, written  # the move with its entry (a trigger's), each write: in its transaction
    # A write that fails fails the move: neither is left.
    other = stored_task(tenant)
    broken = Write.insert([new_row(TaskEvent, task_id=task.pk, generation=None, actor="test", reason="no generation")])
    with pytest.raises(DatabaseError), transaction.atomic():
        _queue(other, 0, (broken,))
    assert Task.objects.get(pk=other.pk).state == State.ACCEPTED
    assert "no generation" not in _reasons(task)
    if connection.vendor == "postgresql":  # (SQLite keeps no lengths)
        # A value too long for its column is refused, as an INSERT of its own refuses it, not cut short.
        long = Write.insert([new_row(TaskEvent, task_id=task.pk, generation=0, actor="x" * 101, reason="long")])
        with pytest.raises(DatabaseError), transaction.atomic():
            _queue(other, 0, (long,))
        assert not TaskEvent.objects.filter(actor__startswith="xxx").exists()


def _statements(captured) -> list[str]:
    return [q["sql"] for q in captured.captured_queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]


def test_an_admissions_and_an_ends_writes_are_in_the_moves_statement_on_both_databases(tenant):
    task = stored_task(tenant)
    channel = VendorChannel.objects.order_by("name").first()
    slots = [new_row(BudgetSlot, channel=channel, kind=kind, task=task) for kind in (BudgetSlot.Kind.JOB, BudgetSlot.Kind.UPLOAD)]
    attempt = new_row(Attempt, task=task, generation=2, owner="w:1", host="h", pid=7, channel=channel)
    with CaptureQueriesContext(connection) as captured:
        moved = lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=0, actor="test",
                                     reason="admitted", then=[lifecycle.Hop(State.RUNNING, "test", "claimed")],
                                     writes=(Write.insert(slots), Write.insert([attempt])))
    assert moved is not None and moved.generation == 2
    assert len(_statements(captured)) == 1, _statements(captured)  # no BEGIN either: one statement is atomic
    assert sorted(BudgetSlot.objects.filter(task=task, released_at=None).values_list("kind", flat=True)) == ["job", "upload"]
    stored = Attempt.objects.get(task=task)
    assert (stored.generation, stored.owner, stored.pid, stored.channel_id, stored.outcome) == (2, "w:1", 7, channel.pk, "running")
    assert stored.started_at is not None and stored.ended_at is None  # auto_now_add, as an INSERT of its own sets it
    # The job's slot released, the upload's kept; the attempt ended; the step's calls logged whatever came of it.
    call = new_row(VendorCall, channel=channel, task_id=task.pk, generation=2, operation="status", outcome="ok",
                   retry_after_s=0.30000000000000004, slow=True)
    with CaptureQueriesContext(connection) as captured:
        ended = lifecycle.transition(
            task.pk, source=State.RUNNING, target=State.SUCCEEDED, generation=2, actor="test", reason="done",
            writes=(Write.change(BudgetSlot, {"released_at": stored.started_at, "release_reason": "bound"},
                                 {"task": task.pk, "kind": [BudgetSlot.Kind.JOB], "released_at": None}),
                    Write.change(Attempt, {"ended_at": stored.started_at, "outcome": "succeeded", "upload_ms": 12},
                                 {"task": task.pk, "generation": 2, "ended_at": None}),
                    Write.insert([call], if_moved=False)))
    assert ended is not None
    assert len(_statements(captured)) == 1, _statements(captured)
    released = dict(BudgetSlot.objects.filter(task=task).values_list("kind", "release_reason"))
    assert released == {"job": "bound", "upload": ""}
    stored = Attempt.objects.get(task=task)
    assert (stored.outcome, stored.upload_ms, stored.ended_at, stored.owner) == ("succeeded", 12, stored.started_at, "w:1")
    logged = VendorCall.objects.get(task_id=task.pk)
    assert (logged.retry_after_s, logged.slow, logged.breaker_failure, logged.at) == (0.30000000000000004, True, False, call.at)
    # Not moved: only the write asked for whatever came of the move is made.
    again = new_row(VendorCall, channel=channel, task_id=task.pk, generation=2, operation="result", outcome="ok")
    assert lifecycle.transition(task.pk, source=State.RUNNING, target=State.FAILED, generation=2, actor="test",
                                reason="late", writes=(Write.change(Attempt, {"outcome": "failed"}, {"task": task.pk}),
                                                       Write.insert([again], if_moved=False))) is None
    assert Attempt.objects.get(task=task).outcome == "succeeded"
    assert VendorCall.objects.filter(task_id=task.pk).count() == 2


def test_a_carried_write_that_fails_fails_the_move(tenant):
    task = stored_task(tenant)
    broken = new_row(Attempt, task=task, generation=None, owner="w:1")
    with pytest.raises(DatabaseError), transaction.atomic():
        lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=0, actor="test",
                             reason="queued", writes=(Write.insert([broken]),))
    assert Task.objects.get(pk=task.pk).state == State.ACCEPTED
    assert not Attempt.objects.filter(task=task).exists() and not TaskEvent.objects.filter(task=task, reason="queued").exists()


def test_the_databases_trigger_is_the_one_the_code_writes(db):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's triggers (PostgreSQL writes in the move's WITH)")
    assert lifecycle.note_triggers_current()


def test_a_new_tasks_insert_carries_its_entry_and_nothing_is_written_for_a_row_copied_with_its_note(tenant):
    """SQLite: a new task's note carries its first history entry (and, at intake, its pre-check's
    message); the trigger writes them only for the row whose id the note names, so a row copied
    with another's note (the benchmark's history, a restore) writes nothing."""
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL writes a task and its entry in one statement of its own (rows.insert_together)")
    import uuid

    from tasks.rows import insert_rows

    task = stored_task(tenant)
    fresh = new_row(Task, tenant=tenant, file=task.file, kind=task.kind, target_format=task.target_format,
                    deadline_at=task.deadline_at)
    entry = new_row(TaskEvent, task_id=fresh.pk, generation=0, actor="test", reason="accepted here")
    assert lifecycle.inserted_with(fresh, [entry]) == ()
    with CaptureQueriesContext(connection) as captured:
        insert_rows([fresh])
    assert len(_statements(captured)) == 1
    assert _reasons(fresh) == {"accepted here"}
    copy = uuid.uuid4()
    columns = [f.column for f in Task._meta.concrete_fields]
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO tasks_task ({', '.join(columns)}) SELECT "
                       f"{', '.join('%s' if c == 'id' else c for c in columns)} FROM tasks_task WHERE id = %s",
                       [copy.hex, fresh.pk.hex])
    assert Task.objects.get(pk=copy).moves_note == Task.objects.get(pk=fresh.pk).moves_note
    assert not TaskEvent.objects.filter(task_id=copy).exists()


@pytest.mark.django_db(transaction=True)  # (a trigger's DDL)
def test_a_trigger_left_from_older_code_is_written_again_after_migrate():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's triggers")
    from django.apps import apps

    from tasks.apps import _note_trigger_current

    with connection.cursor() as cursor:
        cursor.execute(f"DROP TRIGGER {lifecycle.HISTORY_TRIGGER}")
        cursor.execute(f"CREATE TRIGGER {lifecycle.HISTORY_TRIGGER} AFTER UPDATE OF moves_note ON tasks_task "
                       f"BEGIN SELECT 1; END")
    assert not lifecycle.note_triggers_current()
    _note_trigger_current(apps.get_app_config("tasks"), using="default")
    assert lifecycle.note_triggers_current()


def test_a_value_json_cannot_hold_is_written_by_a_statement_of_its_own(tenant):
    task = stored_task(tenant)
    channel = VendorChannel.objects.order_by("name").first()
    call = new_row(VendorCall, channel=channel, task_id=task.pk, generation=1, operation="status", outcome="ok",
                   retry_after_s=float("inf"))
    assert _queue(task, 0, (Write.insert([call]),)) is not None
    assert VendorCall.objects.get(task_id=task.pk).retry_after_s == float("inf")
