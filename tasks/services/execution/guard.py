"""Running a step under a lease, and what a step that crashes leaves behind (never a task nobody
will move again)."""

from __future__ import annotations

import logging
import random
from typing import Any

from tasks import timescale
from tasks.lifecycle import task_update
from tasks.models import Task
from tasks.observability import log_event
from tasks.services.execution.lease import Lease, load_task
from tasks.services.execution.retry import to_reconciling
from tasks.states import TERMINAL_STATES, State
from tasks.vendors.classification import Failure, Outcome
from tasks.vendors.policies import RetryPolicy

S = State
P = Task.Phase


def leased(task_id: Any, generation: int, state: State, body, *, phase: str | None = None) -> str:
    """Run one step under a lease on the task at (state, generation); a stale message does nothing."""
    task = load_task(task_id)
    if task is None or task.state != state or task.generation != generation or (phase and task.phase != phase):
        return "stale"
    lease = Lease.claim(task)
    if lease is None:
        return "busy"
    try:
        return body(task)
    except Exception as exc:
        step_crashed(task, exc)
        return "crashed"
    finally:
        lease.release()


def step_crashed(task: Task, exc: BaseException) -> None:
    """A bug, or an answer nobody foresaw, must not leave the task without a lease and a due time:
    a create that may have happened is reconciled, anything else is tried again later."""
    log_event("step_crashed", logging.ERROR, task_id=task.pk, generation=task.generation, reason=type(exc).__name__)
    row = Task.objects.filter(pk=task.pk).values("state", "generation", "phase", "due_at").first()
    if row is None or row["state"] in TERMINAL_STATES or row["due_at"] is not None:
        return
    current = Task.objects.select_related("channel").get(pk=task.pk)
    failure = Failure(Outcome.AMBIGUOUS, code="step_crashed", message=f"the step failed unexpectedly ({type(exc).__name__})",
                      error_class=type(exc).__name__)
    if current.state == S.RUNNING and current.phase in (P.UPLOAD, P.CREATE, ""):
        to_reconciling(current, failure, operation="a step")
        return
    task_update(current.pk, state=current.state, generation=current.generation, enqueued_at=None,
                due_at=timescale.after(RetryPolicy().cap_s * random.uniform(0.5, 1.0)))
