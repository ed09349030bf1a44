"""django-q2 entry points. Each parses its message and calls one service; the task table decides
whether there is anything to do (a stale or duplicated message does nothing)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import close_old_connections

from tasks.observability import log_event

F = TypeVar("F", bound=Callable[..., Any])


def entry_point(handler: F) -> F:
    """A message's handler: a usable database connection first, and the vendor calls it made
    written before the worker takes the next message."""

    @functools.wraps(handler)
    def run(*args: Any, **kwargs: Any) -> Any:
        from tasks.vendors.http import flush_calls

        close_old_connections()
        try:
            return handler(*args, **kwargs)
        finally:
            flush_calls()

    return run  # type: ignore[return-value]


@entry_point
def run_step(step: str, task_id: str, generation: int) -> str:
    from tasks.services.dispatch import dispatch_soon
    from tasks.services.outcomes import listening

    with listening() as heard:
        step, outcome = _steps(step, task_id, generation)
    if step == "precheck" or outcome in ("stale", "busy", "lost_claim"):
        return outcome
    # A task that left its slots in a terminal move heard there whether any lane waits for them;
    # otherwise its row says whether it left them, and the lanes are read.
    waiting = heard.get(str(task_id))
    if waiting or (waiting is None and _left_its_slots(task_id, outcome)):
        # Its vendor slot is shared by every lane, so the lanes are offered it in dispatch order
        # (interactive first), not only the task's own lane.
        dispatch_soon(None)
    return outcome


def _steps(step: str, task_id: str, generation: int) -> tuple[str, str]:
    """Run the message's step, and the start of a task its pre-check admitted into this very
    lane: (the step that ran last, its outcome)."""
    from tasks.services import execution, intake

    handlers = {
        "precheck": functools.partial(intake.task_precheck_and_route_here, worker_lane=os.environ.get("Q_CLUSTER_NAME")),
        "start": execution.step_start,
        "poll": execution.step_poll,
        "fetch": execution.step_fetch,
        "reconcile": execution.step_reconcile,
        "cancel": execution.step_cancel,
    }
    started = time.monotonic()
    outcome = handlers[step](task_id, int(generation))
    admitted = None
    if step == "precheck":
        outcome, admitted = outcome.outcome, outcome.task
    log_event("step", step=step, task_id=task_id, generation=generation, decision=outcome,
              duration_ms=int((time.monotonic() - started) * 1000))
    here = None
    if step == "precheck" and outcome == "queued_here":
        # Admitted at once into this very lane, with no start message sent for it: as it arrived
        # (and claimed for this worker in the same move: `admitted` is RUNNING), or by the pass
        # its arrival ran (its generation is then the pre-check's one transition on: admission
        # does not move it; were it not, the start would answer "stale" and the dispatcher send
        # the start it presumes lost).
        here = admitted.generation if admitted is not None else int(generation) + 1
    elif step == "precheck" and outcome == "queued":
        # Another pass may have admitted it meanwhile (and sent its start message): it is
        # started here all the same, not behind the pre-checks queued on this lane's cluster.
        row = _dispatched_here(task_id)
        here = row["generation"] if row is not None else None
    if here is not None:
        step, generation = "start", here
        started = time.monotonic()
        outcome = execution.step_start(task_id, generation, task=admitted)
        log_event("step", step=step, task_id=task_id, generation=generation, decision=outcome,
                  duration_ms=int((time.monotonic() - started) * 1000))
    return step, outcome


def _dispatched_here(task_id: str) -> dict | None:
    """The task's row if it was dispatched into the lane whose cluster runs this worker."""
    from tasks.models import Task
    from tasks.states import State

    lane = os.environ.get("Q_CLUSTER_NAME")
    if not lane:
        return None
    return Task.objects.filter(pk=task_id, state=State.QUEUED, dispatched_at__isnull=False, lane_id=lane).values(
        "generation").first()


def _left_its_slots(task_id: str, outcome: str) -> bool:
    """Whether the task is no longer in flight: a step that moved it to SUCCEEDED says so itself,
    any other outcome is read from its row."""
    from tasks.models import Task
    from tasks.states import IN_FLIGHT_STATES

    if outcome == "succeeded":
        return True
    row = Task.objects.filter(pk=task_id).values("state").first()
    return bool(row) and row["state"] not in IN_FLIGHT_STATES


@entry_point
def run_notification(notification_id: int) -> str:
    from tasks.services.notifications import notification_deliver

    return notification_deliver(notification_id=int(notification_id))


@entry_point
def run_vendor_job_cleanup(vendor_job_pk: int) -> str:
    from tasks.services.execution import step_vendor_job_cleanup

    return step_vendor_job_cleanup(int(vendor_job_pk))


@entry_point
def run_billing_audit(task_id: str) -> str:
    from tasks.services.execution import step_billing_audit

    return step_billing_audit(task_id)


@entry_point
def run_probe(channel_name: str) -> str:
    from tasks.services.execution import step_probe

    return step_probe(channel_name)


@entry_point
def run_ledger_sync(channel_name: str) -> dict[str, Any]:
    from tasks.services.billing import ledger_sync_due

    return ledger_sync_due(channel_name)


@entry_point
def run_sweep() -> dict[str, Any]:
    """The django-q2 schedule's safety net when no dispatcher loop is running."""
    from tasks.services.dispatch import tick

    return tick()


@entry_point
def run_housekeeping() -> dict[str, int]:
    """Retention and orphans: results past retention, unreferenced outputs, expired quarantine, old keys."""
    from tasks.services.housekeeping import housekeeping

    return housekeeping()
