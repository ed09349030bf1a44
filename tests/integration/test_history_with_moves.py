"""A move's history entries are written by the move's own statement on both databases: on
PostgreSQL a WITH feeds the UPDATE's RETURNING into the INSERT; on SQLite, which has no writable
WITH, a trigger copies the entries the UPDATE wrote into the task's `moves_note` column. Exactly
the entries of the moves that happened, never again for a later write of the row."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from tasks import lifecycle
from tasks.models import Task, TaskEvent
from tasks.states import State
from tests.support.flows import stored_task

pytestmark = pytest.mark.django_db(transaction=True)


def _entries(task: Task) -> list[tuple]:
    return list(TaskEvent.objects.filter(task=task).order_by("id")
                .values_list("from_state", "to_state", "generation", "actor", "reason", "data"))


def _sent(statements: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in statements.captured_queries]


def test_a_move_outside_a_transaction_is_one_statement_with_its_history_entry(tenant):
    task = stored_task(tenant)
    with CaptureQueriesContext(connection) as statements:
        moved = lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=0, actor="test",
                                     reason="queued ’ünïcode’", data={"lane": "batch", "n": [1, 2], "q": "'\"\\"})
    assert moved is not None and moved.generation == 1
    assert len(_sent(statements)) == 1, _sent(statements)
    assert _entries(task) == [("ACCEPTED", "QUEUED", 1, "test", "queued ’ünïcode’",
                               {"lane": "batch", "n": [1, 2], "q": "'\"\\"})]
    entry, row = TaskEvent.objects.get(task=task), Task.objects.get(pk=task.pk)
    assert entry.at == row.updated_at


def test_a_move_of_several_hops_writes_an_entry_a_hop_in_their_order(tenant):
    task = stored_task(tenant)
    moved = lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=0, actor="admission",
                                 reason="admitted", then=[lifecycle.Hop(State.RUNNING, "worker", "claimed", {"w": 1})])
    assert moved is not None and moved.generation == 2
    assert _entries(task) == [("ACCEPTED", "QUEUED", 1, "admission", "admitted", {}),
                              ("QUEUED", "RUNNING", 2, "worker", "claimed", {"w": 1})]


def test_a_recorded_update_is_one_statement_with_its_entry(tenant):
    task = stored_task(tenant)
    with CaptureQueriesContext(connection) as statements:
        recorded = lifecycle.task_update_recorded(task.pk, state=State.ACCEPTED, generation=0, actor="test",
                                                  reason="found", data={"k": "v"}, waiting_reason="y")
    assert recorded is not None and recorded.generation == 0
    assert len(_sent(statements)) == 1, _sent(statements)
    assert _entries(task) == [("", "", 0, "test", "found", {"k": "v"})]


def test_two_equal_findings_are_two_entries(tenant):
    task = stored_task(tenant)
    for _ in range(2):
        assert lifecycle.task_update_recorded(task.pk, state=State.ACCEPTED, generation=0, actor="test",
                                              reason="found", waiting_reason="y")
    assert _entries(task) == [("", "", 0, "test", "found", {})] * 2


def test_later_writes_of_the_row_add_no_entry(tenant):
    task = stored_task(tenant)
    lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=0, actor="test", reason="queued")
    older = Task.objects.get(pk=task.pk)  # read with the first move's note
    lifecycle.task_update_recorded(task.pk, state=State.QUEUED, generation=1, actor="test", reason="found")
    before = _entries(task)
    older.save()  # a whole row written back from before the finding: the first move's note, a newer updated_at
    assert lifecycle.task_update(task.pk, state=State.QUEUED, generation=1, waiting_reason="x")
    Task.objects.filter(pk=task.pk).update(reconcile_rounds=3)
    row = Task.objects.get(pk=task.pk)
    row.waiting_reason = "saved whole"
    row.save()
    with transaction.atomic():
        Task.objects.select_for_update().filter(pk=task.pk).update(waiting_reason="z")
    assert _entries(task) == before


def test_a_move_that_did_not_happen_writes_no_entry(tenant):
    task = stored_task(tenant)
    assert lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=7, actor="test",
                                reason="stale") is None
    assert lifecycle.transition(task.pk, source=State.QUEUED, target=State.RUNNING, generation=0, actor="test",
                                reason="wrong state") is None
    assert _entries(task) == []


def test_a_move_in_a_transaction_that_rolls_back_leaves_no_entry(tenant):
    task = stored_task(tenant)
    with pytest.raises(RuntimeError), transaction.atomic():
        lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=0, actor="test", reason="q")
        raise RuntimeError("the caller fails")
    assert _entries(task) == [] and Task.objects.get(pk=task.pk).state == State.ACCEPTED
