"""The lifecycle table, pair by pair (no database)."""

import itertools

import pytest

from tasks.lifecycle import TRANSITIONS, is_allowed
from tasks.states import TERMINAL_STATES, State

ALLOWED = {
    (State.ACCEPTED, State.QUEUED), (State.ACCEPTED, State.FAILED), (State.ACCEPTED, State.CANCELLED),
    (State.ACCEPTED, State.EXPIRED),
    (State.QUEUED, State.RUNNING), (State.QUEUED, State.CANCELLED), (State.QUEUED, State.EXPIRED),
    (State.QUEUED, State.FAILED), (State.QUEUED, State.RETRY_WAIT),
    (State.RUNNING, State.SUCCEEDED), (State.RUNNING, State.RETRY_WAIT), (State.RUNNING, State.RECONCILING),
    (State.RUNNING, State.FAILED), (State.RUNNING, State.CANCEL_REQUESTED),
    (State.RETRY_WAIT, State.QUEUED), (State.RETRY_WAIT, State.CANCELLED), (State.RETRY_WAIT, State.FAILED),
    (State.RECONCILING, State.RUNNING), (State.RECONCILING, State.RETRY_WAIT), (State.RECONCILING, State.FAILED),
    (State.RECONCILING, State.CANCEL_REQUESTED), (State.RECONCILING, State.RECONCILING),
    (State.CANCEL_REQUESTED, State.CANCELLED), (State.CANCEL_REQUESTED, State.CANCEL_REQUESTED),
    (State.FAILED, State.QUEUED), (State.EXPIRED, State.QUEUED),
}


@pytest.mark.parametrize("source,target", list(itertools.product(State, State)))
def test_every_pair_matches_the_documented_table(source, target):
    assert is_allowed(source, target) == ((source, target) in ALLOWED)


def test_the_table_names_every_state():
    assert set(TRANSITIONS) == set(State)


def test_succeeded_and_cancelled_are_final():
    assert TRANSITIONS[State.SUCCEEDED] == frozenset()
    assert TRANSITIONS[State.CANCELLED] == frozenset()


def test_a_running_task_can_only_end_through_its_attempt_or_a_cancel_request():
    # CANCELLED is never reached from RUNNING directly: the execution must be confirmed stopped.
    assert not is_allowed(State.RUNNING, State.CANCELLED)
    assert all(t not in TERMINAL_STATES or t in (State.SUCCEEDED, State.FAILED) for t in TRANSITIONS[State.RUNNING])
