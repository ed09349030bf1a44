"""django-q2 entry points. Each parses its message and calls one service; the task table decides
whether there is anything to do (a stale or duplicated message does nothing)."""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import close_old_connections

from tasks.observability import log_event


def run_step(step: str, task_id: str, generation: int) -> str:
    from tasks.services import execution, intake
    from tasks.services.dispatch import dispatch_soon

    handlers = {
        "precheck": intake.task_precheck_and_route,
        "start": execution.step_start,
        "poll": execution.step_poll,
        "fetch": execution.step_fetch,
        "reconcile": execution.step_reconcile,
        "cancel": execution.step_cancel,
    }
    close_old_connections()
    started = time.monotonic()
    outcome = handlers[step](task_id, int(generation))
    log_event("step", step=step, task_id=task_id, generation=generation, decision=outcome,
              duration_ms=int((time.monotonic() - started) * 1000))
    if step == "precheck" and outcome == "queued":
        # Admitted at once into this very lane: start here instead of queueing the start
        # behind other messages (the start message sent anyway then finds nothing to do).
        row = _dispatched_here(task_id)
        if row is not None:
            step, generation = "start", row["generation"]
            started = time.monotonic()
            outcome = execution.step_start(task_id, generation)
            log_event("step", step=step, task_id=task_id, generation=generation, decision=outcome,
                      duration_ms=int((time.monotonic() - started) * 1000))
    if step != "precheck" and outcome not in ("stale", "busy", "lost_claim"):
        from tasks.models import Task
        from tasks.states import IN_FLIGHT_STATES

        row = Task.objects.filter(pk=task_id).values("lane_id", "state").first()
        if row and row["state"] not in IN_FLIGHT_STATES:
            # The task left its slots. Its vendor slot is shared by every lane, so the lanes are
            # offered it in dispatch order (interactive first), not only the task's own lane.
            dispatch_soon(None)
    return outcome


def _dispatched_here(task_id: str) -> dict | None:
    """The task's row if it was dispatched into the lane whose cluster runs this worker."""
    from tasks.models import Task
    from tasks.states import State

    lane = os.environ.get("Q_CLUSTER_NAME")
    if not lane:
        return None
    return Task.objects.filter(pk=task_id, state=State.QUEUED, dispatched_at__isnull=False, lane_id=lane).values(
        "generation").first()


def run_notification(notification_id: int) -> str:
    from tasks.services.notifications import notification_deliver

    close_old_connections()
    return notification_deliver(notification_id=int(notification_id))


def run_vendor_job_cleanup(vendor_job_pk: int) -> str:
    from tasks.services.execution import step_vendor_job_cleanup

    close_old_connections()
    return step_vendor_job_cleanup(int(vendor_job_pk))


def run_billing_audit(task_id: str) -> str:
    from tasks.services.execution import step_billing_audit

    close_old_connections()
    return step_billing_audit(task_id)


def run_probe(channel_name: str) -> str:
    from tasks.services.execution import step_probe

    close_old_connections()
    return step_probe(channel_name)


def run_ledger_sync(channel_name: str) -> dict[str, Any]:
    from tasks.services.billing import ledger_sync_due

    close_old_connections()
    return ledger_sync_due(channel_name)


def run_sweep() -> dict[str, Any]:
    """The django-q2 schedule's safety net when no dispatcher loop is running."""
    from tasks.services.dispatch import tick

    close_old_connections()
    return tick()


def run_housekeeping() -> dict[str, int]:
    """Retention and orphans: results past retention, unreferenced outputs, expired quarantine, old keys."""
    from tasks.services.housekeeping import housekeeping

    close_old_connections()
    return housekeeping()
