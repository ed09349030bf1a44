"""Cancelling: at once for work that has not started; a request while it runs.

Cancel and success race through compare-and-set: whichever commits first wins, the other sees
that the task moved and acts on it (409 already_finished, or the late result discarded).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from tasks.errors import AlreadyFinished, TaskNotFound
from tasks.models import Attempt, Task
from tasks.services.outcomes import task_move
from tasks.states import TERMINAL_STATES, State

IMMEDIATE = (State.ACCEPTED, State.QUEUED, State.RETRY_WAIT)
REQUESTED = (State.RUNNING, State.RECONCILING)


@dataclass(frozen=True)
class CancelOutcome:
    state: str
    changed: bool


def task_cancel(*, task_id, actor: str, reason: str = "cancel requested") -> CancelOutcome:
    for _ in range(10):
        task = Task.objects.filter(pk=task_id).values("state", "generation").first()
        if task is None:
            raise TaskNotFound()
        state, generation = State(task["state"]), task["generation"]
        if state in TERMINAL_STATES:
            raise AlreadyFinished(f"The task already finished: {state}.", state=state)
        if state == State.CANCEL_REQUESTED:
            return CancelOutcome(state=state, changed=False)
        if state in IMMEDIATE:
            # Any queue message for it now carries a stale generation and is skipped.
            if task_move(
                task_id, source=state, target=State.CANCELLED, generation=generation, actor=actor,
                reason=f"{reason}: not started, cancelled at once",
            ):
                return CancelOutcome(state=State.CANCELLED, changed=True)
            continue
        # Running: ask the worker (it stops at its next heartbeat) and the vendor to stop.
        if task_move(
            task_id, source=state, target=State.CANCEL_REQUESTED, generation=generation, actor=actor,
            reason=f"{reason}: waiting for the execution to stop",
            fields=dict(cancel_requested_at=timezone.now(), due_at=timezone.now(), enqueued_at=None),
            attempt_outcome=Attempt.Outcome.CANCELLED if state == State.RUNNING else None,
        ):
            return CancelOutcome(state=State.CANCEL_REQUESTED, changed=True)
    raise AlreadyFinished("The task keeps changing; try again.")
