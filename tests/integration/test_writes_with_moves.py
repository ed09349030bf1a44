"""Writes that go with a task's move (`tasks.rows.Write`, `lifecycle.transition(writes=…)` and its
kin): made only if the task moved, or whatever came of the move when asked so; on PostgreSQL in
the move's own statement, on SQLite after it in its transaction. Both databases."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from tasks import lifecycle
from tasks.models import Task, TaskEvent
from tasks.rows import Write, new_row
from tasks.states import State
from tests.support.flows import stored_task


def _note(task: Task, reason: str, *, if_moved: bool = True) -> Write:
    return Write.insert([new_row(TaskEvent, task_id=task.pk, generation=task.generation, actor="test", reason=reason)],
                        if_moved=if_moved)


def _renamed(task: Task, reason: str, to: str) -> Write:
    return Write.change(TaskEvent, {"reason": to}, "t.task_id = %s AND t.reason = %s", [("task", task.pk), ("reason", reason)])


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
