"""The task lifecycle: the one table of allowed transitions and the one function that writes state.

Every state change is a compare-and-set UPDATE (`WHERE id AND state AND generation`) that bumps
the generation and appends a TaskEvent in the same transaction. The generation is the fencing
token: whoever read the task at generation N can only write while it is still at N. An update
count of 0 means someone else moved the task first; callers handle that, it is not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from tasks.models import Task, TaskEvent
from tasks.states import State

S = State

# from-state → the states it may move to. Self-transitions exist only to fence (bump the
# generation of) a step whose lease expired, so a zombie worker can no longer write.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.ACCEPTED: frozenset({S.QUEUED, S.FAILED, S.CANCELLED, S.EXPIRED}),
    # QUEUED → RETRY_WAIT parks work no channel can take (every vendor down): it waits durably
    # for recovery instead of running out its queue deadline.
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED, S.EXPIRED, S.FAILED, S.RETRY_WAIT}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.RETRY_WAIT, S.RECONCILING, S.FAILED, S.CANCEL_REQUESTED}),
    S.RETRY_WAIT: frozenset({S.QUEUED, S.CANCELLED, S.FAILED}),
    S.RECONCILING: frozenset({S.RUNNING, S.RETRY_WAIT, S.FAILED, S.CANCEL_REQUESTED, S.RECONCILING}),
    S.CANCEL_REQUESTED: frozenset({S.CANCELLED, S.CANCEL_REQUESTED}),
    S.SUCCEEDED: frozenset(),
    # Operators replay failed or expired work (dead letters, released quarantine): a new
    # generation of the same task, never a new task.
    S.FAILED: frozenset({S.QUEUED}),
    S.CANCELLED: frozenset(),
    S.EXPIRED: frozenset({S.QUEUED}),
}

# Columns that only this module may write.
_PROTECTED = {"state", "generation", "id", "tenant", "tenant_id"}


class IllegalTransition(Exception):
    """The lifecycle table does not allow this transition."""


def is_allowed(source: State | str, target: State | str) -> bool:
    return State(target) in TRANSITIONS[State(source)]


@dataclass(frozen=True)
class Moved:
    """A transition that happened: the task is now at `generation`."""

    generation: int


def transition(
    task_id: Any,
    *,
    source: State | str,
    target: State | str,
    generation: int,
    actor: str,
    reason: str,
    fields: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
) -> Moved | None:
    """Move a task from `source` at `generation` to `target`; None if it was not there any more."""
    source, target = State(source), State(target)
    if not is_allowed(source, target):
        raise IllegalTransition(f"{source} → {target} is not in the lifecycle table")
    changes = dict(fields or {})
    if _PROTECTED & changes.keys():
        raise IllegalTransition(f"transition fields may not include {_PROTECTED & changes.keys()}")
    now = timezone.now()
    changes["updated_at"] = now
    # Inside a caller's transaction no savepoint of its own: a failure here fails the caller's.
    with transaction.atomic(savepoint=False):
        updated = Task.objects.filter(pk=task_id, state=source, generation=generation).update(
            state=target, generation=F("generation") + 1, **changes
        )
        if not updated:
            return None
        TaskEvent.objects.create(
            task_id=task_id,
            from_state=source,
            to_state=target,
            generation=generation + 1,
            actor=actor[:100],
            reason=reason[:300],
            data=data or {},
        )
    return Moved(generation=generation + 1)


def task_update(task_id: Any, *, state: State | str, generation: int, expect: dict[str, Any] | None = None,
                **fields: Any) -> bool:
    """Write non-state columns only if the task is still at (state, generation) and, with
    `expect`, those columns still hold what the caller read."""
    if _PROTECTED & fields.keys():
        raise IllegalTransition("use transition() to change state or generation")
    fields["updated_at"] = timezone.now()
    return bool(Task.objects.filter(pk=task_id, state=state, generation=generation, **(expect or {})).update(**fields))


def record_event(task_id: Any, *, generation: int, actor: str, reason: str, data: dict | None = None) -> None:
    """Append a history entry that is not a state change (a decision, a finding)."""
    TaskEvent.objects.create(
        task_id=task_id, generation=generation, actor=actor[:100], reason=reason[:300], data=data or {}
    )
