"""Running a step under a lease, and what a step that crashes leaves behind (never a task nobody
will move again)."""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from typing import Any

from tasks import timescale
from tasks.lifecycle import record_event, task_update
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
    started = time.monotonic()
    outcome = None
    try:
        outcome = body(task)
        return outcome
    except Exception as exc:
        step_crashed(task, exc)
        return "crashed"
    except SystemExit as stop:
        step_interrupted(task, stop, started)
        raise
    finally:
        # A step that moved the task to SUCCEEDED let its lease go with that move.
        lease.release(row=outcome != "succeeded")


def step_interrupted(task: Task, stop: SystemExit, started: float) -> None:
    """The step did not end by itself: django-q2 killed it at its timeout (a zombie that outlived
    its attempt and the grace), or its worker is stopping. Either way the task is left due."""
    killed = type(stop).__name__ == "TimeoutException"
    log_event("step_killed" if killed else "step_interrupted", logging.WARNING, task_id=task.pk, kind=task.kind,
              generation=task.generation, state=task.state, step=task.phase or None,
              elapsed_s=round(time.monotonic() - started, 3), pid=os.getpid(), host=socket.gethostname())
    # The signal may have landed inside a query: psycopg then cancels it and closes the
    # connection, and the hand-back below needs a fresh one (else the lease's expiry is the
    # only way back, 30 s later).
    _fresh_connection()
    try:
        step_handed_back(task)
    except Exception as exc:  # the lease's expiry remains the way back; say why this one failed
        log_event("hand_back_failed", logging.ERROR, task_id=task.pk, reason=f"{type(exc).__name__}: {exc}"[:300])


def _fresh_connection() -> None:
    from django.db import connection

    if connection.connection is None:
        return
    try:
        usable = connection.is_usable()
    except Exception:
        usable = False
    if not usable:
        connection.close()


def step_crashed(task: Task, exc: BaseException) -> None:
    """A bug, or an answer nobody foresaw, must not leave the task without a lease and a due time:
    a create that may have happened is reconciled, anything else is tried again later."""
    log_event("step_crashed", logging.ERROR, task_id=task.pk, generation=task.generation, reason=type(exc).__name__)
    failure = Failure(Outcome.AMBIGUOUS, code="step_crashed", message=f"the step failed unexpectedly ({type(exc).__name__})",
                      error_class=type(exc).__name__)
    _leave_due(task, failure, delay_s=RetryPolicy().cap_s * random.uniform(0.5, 1.0),
               reason="crashed: tried again later")


def step_handed_back(task: Task) -> None:
    """The worker is stopping (SIGTERM) in the middle of the step: the task is given back at once —
    reconciled if a create may have been sent, due now otherwise — not left to its lease's expiry."""
    failure = Failure(Outcome.AMBIGUOUS, code="worker_stopped", message="the worker stopped in the middle of the step",
                      error_class="WorkerStopped")
    _leave_due(task, failure, delay_s=0.0, reason="handed back by a stopping worker")


def _leave_due(task: Task, failure: Failure, *, delay_s: float, reason: str) -> None:
    row = Task.objects.filter(pk=task.pk).values("state", "generation", "phase", "due_at", "lease_owner").first()
    if row is None or row["state"] in TERMINAL_STATES or (row["due_at"] is not None and delay_s > 0):
        return
    if (row["state"], row["generation"]) != (task.state, task.generation) and row["due_at"] is not None:
        return  # moved on (fenced, cancelled): whoever moved it decided what comes next
    current = Task.objects.select_related("channel").get(pk=task.pk)
    if current.state == S.RUNNING and current.phase in (P.UPLOAD, P.CREATE, ""):
        to_reconciling(current, failure, operation=f"a step ({reason})")
        return
    if task_update(current.pk, state=current.state, generation=current.generation, enqueued_at=None,
                   lease_owner="", lease_expires_at=None, due_at=timescale.after(delay_s)):
        record_event(current.pk, generation=current.generation, actor="worker", reason=f"step {reason}",
                     data={"error_class": failure.error_class})
