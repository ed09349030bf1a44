"""Claims and fencing: one winner per race, and a fenced attempt can change nothing."""

import contextlib
import threading

import pytest
from django.db import connection

from tasks import lifecycle
from tasks.models import Task, TaskEvent, VendorJob
from tasks.services import execution
from tasks.states import State
from tests.support.flows import route, submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def dispatched_task(api) -> Task:
    task = route(submit_file(api))
    assert task.state == "QUEUED" and task.dispatched_at is not None, task.state
    return task


def test_two_claimers_racing_for_one_task_have_exactly_one_winner(vendor, api):
    task = dispatched_task(api)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def claim():
        try:
            barrier.wait()
            outcomes.append(execution.step_start(task.pk, task.generation))
        finally:
            connection.close()

    threads = [threading.Thread(target=claim) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["lost_claim", "started"] or sorted(outcomes) == ["stale", "started"], outcomes
    assert TaskEvent.objects.filter(task=task, to_state="RUNNING").count() == 1
    assert VendorJob.objects.filter(task=task).count() == 1
    assert vendor.control.invariants()["billed_jobs"] == 1


def test_a_duplicated_start_message_after_the_claim_does_nothing(vendor, api):
    task = dispatched_task(api)
    assert execution.step_start(task.pk, task.generation) == "started"
    assert execution.step_start(task.pk, task.generation) == "stale"
    assert vendor.control.invariants()["billed_jobs"] == 1


def test_a_fenced_attempt_cannot_write_state_or_results(vendor, api):
    task = dispatched_task(api)
    execution.step_start(task.pk, task.generation)
    running = Task.objects.get(pk=task.pk)
    assert running.state == "RUNNING"
    # The watchdog fences the attempt (generation bump)...
    moved = lifecycle.transition(running.pk, source=State.RUNNING, target=State.RECONCILING,
                                 generation=running.generation, actor="test", reason="fence")
    assert moved is not None
    # ...so whatever the old attempt tries afterwards loses its compare-and-set.
    assert lifecycle.transition(running.pk, source=State.RUNNING, target=State.SUCCEEDED,
                                generation=running.generation, actor="old", reason="late") is None
    assert not lifecycle.task_update(running.pk, state=State.RUNNING, generation=running.generation, result_sha256="x")
    assert execution.step_poll(running.pk, running.generation) == "stale"
    after = Task.objects.get(pk=task.pk)
    assert after.state == "RECONCILING" and after.result_sha256 == ""


@contextlib.contextmanager
def _writes():
    """The statements run inside, but for the transaction's own (BEGIN, savepoints)."""
    statements: list[str] = []

    def spy(execute, sql, params, many, context):
        if not sql.startswith(("SAVEPOINT", "RELEASE", "BEGIN")):
            statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        yield statements


def test_every_allowed_transition_writes_an_event_and_every_other_is_refused(db, api):
    task = Task.objects.get(pk=submit_file(api))
    for source in State:
        for target in State:
            Task.objects.filter(pk=task.pk).update(state=source)
            generation = Task.objects.get(pk=task.pk).generation
            if lifecycle.is_allowed(source, target):
                assert lifecycle.transition(task.pk, source=source, target=target, generation=generation,
                                            actor="t", reason="walk") is not None
                assert TaskEvent.objects.filter(task=task, from_state=source, to_state=target).exists()
            else:
                with pytest.raises(lifecycle.IllegalTransition):
                    lifecycle.transition(task.pk, source=source, target=target, generation=generation,
                                         actor="t", reason="walk")


def test_state_and_generation_cannot_be_smuggled_in_as_extra_fields(db, api):
    task = Task.objects.get(pk=submit_file(api))
    with pytest.raises(lifecycle.IllegalTransition):
        lifecycle.transition(task.pk, source=task.state, target=State.QUEUED, generation=task.generation,
                             actor="t", reason="x", fields={"generation": 99})
    with pytest.raises(lifecycle.IllegalTransition):
        lifecycle.task_update(task.pk, state=task.state, generation=task.generation, tenant_id=None)
    assert Task.objects.get(pk=task.pk).state == "ACCEPTED"


def test_a_transition_writes_its_fields_and_exactly_one_history_entry_or_nothing(db, api):
    """The compare-and-set and its history entry (one statement on both databases): the entry carries
    what the caller said, expressions and related rows in the fields are applied, and a
    transition that lost its compare-and-set leaves neither a change nor an entry."""
    from django.db.models import F

    task = Task.objects.select_related("lane").get(pk=submit_file(api))
    with _writes() as writes:
        moved = lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=task.generation,
                                     actor="a" * 150, reason="into the lane", data={"lane": "batch", "pages": None},
                                     fields=dict(lane=task.lane, attempts=F("attempts") + 2, error_code="x"))
    assert moved is not None and moved.generation == task.generation + 1
    after = Task.objects.get(pk=task.pk)
    assert (after.state, after.generation, after.attempts, after.error_code) == ("QUEUED", task.generation + 1,
                                                                                 task.attempts + 2, "x")
    event = TaskEvent.objects.get(task=task, to_state="QUEUED")
    assert (event.from_state, event.generation, event.actor, event.reason, event.data) == (
        "ACCEPTED", task.generation + 1, "a" * 100, "into the lane", {"lane": "batch", "pages": None})
    assert len(writes) == 1, writes  # on SQLite the trigger writes the entries

    # The same transition again, from the generation it started at: lost, and nothing written.
    assert lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=task.generation,
                                actor="late", reason="late") is None
    assert Task.objects.get(pk=task.pk).generation == task.generation + 1
    assert TaskEvent.objects.filter(task=task, to_state="QUEUED").count() == 1


def test_a_transition_expecting_a_column_moves_only_while_it_holds_what_was_read(db, api):
    """`expect`: columns the compare-and-set also compares (None for NULL); a task whose column
    changed since it was read does not move and gets no history entry."""
    from django.utils import timezone

    task = Task.objects.get(pk=submit_file(api))
    Task.objects.filter(pk=task.pk).update(dispatched_at=timezone.now())
    with pytest.raises(TypeError):
        lifecycle.transition(task.pk, source=task.state, target=State.CANCELLED, generation=task.generation,
                             actor="t", reason="x", expect={"generation": 0})
    assert lifecycle.transition(task.pk, source=task.state, target=State.CANCELLED, generation=task.generation,
                                actor="t", reason="x", expect={"dispatched_at": None}) is None
    assert not TaskEvent.objects.filter(task=task, to_state="CANCELLED").exists()
    Task.objects.filter(pk=task.pk).update(dispatched_at=None)
    assert lifecycle.transition(task.pk, source=task.state, target=State.CANCELLED, generation=task.generation,
                                actor="t", reason="x", expect={"dispatched_at": None}) is not None
    assert Task.objects.get(pk=task.pk).state == "CANCELLED"


def test_a_move_through_several_states_records_each_and_is_refused_where_any_step_is(db, api):
    """A move with `then` (a worker admitting a task and claiming it at once): one compare-and-set,
    each transition checked against the table and recorded in order with its own generation; a
    path with a step the table does not allow writes nothing."""
    task = Task.objects.select_related("lane").get(pk=submit_file(api))
    with pytest.raises(lifecycle.IllegalTransition):
        lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=task.generation,
                             actor="t", reason="x", then=[lifecycle.Hop(State.SUCCEEDED, "t", "skip")])
    with _writes() as writes:
        moved = lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=task.generation,
                                     actor="precheck", reason="into the lane", data={"lane": "batch"},
                                     fields={"lane": task.lane, "lease_owner": "w"},
                                     then=[lifecycle.Hop(State.RUNNING, "worker w", "claimed", {"queue_wait_s": 0})])
    assert moved is not None and moved.generation == task.generation + 2
    after = Task.objects.get(pk=task.pk)
    assert (after.state, after.generation, after.lease_owner) == ("RUNNING", task.generation + 2, "w")
    entries = list(TaskEvent.objects.filter(task=task).exclude(to_state="ACCEPTED").order_by("at", "id")
                   .values_list("from_state", "to_state", "generation", "actor", "data"))
    assert entries == [("ACCEPTED", "QUEUED", task.generation + 1, "precheck", {"lane": "batch"}),
                       ("QUEUED", "RUNNING", task.generation + 2, "worker w", {"queue_wait_s": 0})]
    assert len(writes) == 1, writes  # on SQLite the trigger writes the entries
    # Lost: nothing written.
    assert lifecycle.transition(task.pk, source=State.ACCEPTED, target=State.QUEUED, generation=task.generation,
                                actor="late", reason="late", then=[lifecycle.Hop(State.RUNNING, "l", "l")]) is None
    assert TaskEvent.objects.filter(task=task).exclude(to_state="ACCEPTED").count() == 2

