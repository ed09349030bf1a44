"""The cancel step: CANCEL_REQUESTED → CANCELLED once the vendor confirms no job is running."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from tasks import timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, Task, VendorJob
from tasks.services.execution.guard import leased
from tasks.services.execution.jobs import cancel_vendor_job, operation_of, record_job, vendor_of
from tasks.services.execution.lease import actor
from tasks.services.outcomes import task_move
from tasks.states import State
from tasks.vendors.errors import VendorError
from tasks.vendors.policies import PollPolicy, RetryPolicy

S = State
P = Task.Phase


def step_cancel(task_id: Any, generation: int) -> str:
    """CANCEL_REQUESTED → CANCELLED once the vendor confirms, or the job is over, or none exists."""
    return leased(task_id, generation, S.CANCEL_REQUESTED, _cancel)


def _cancel(task: Task) -> str:
    generation = task.generation
    channel = task.channel
    open_jobs = list(VendorJob.objects.filter(task=task, terminal_at__isnull=True))
    vendor = vendor_of(task) if channel is not None else None
    if vendor is not None and task.vendor_client_ref and vendor.capabilities.can_reconcile:
        try:
            for view in vendor.find_jobs(operation_of(task)):
                job = record_job(task, channel, view, adopted=True)
                if job.terminal_at is None and job not in open_jobs:
                    open_jobs.append(job)
        except VendorError:
            task_update(task.pk, state=S.CANCEL_REQUESTED, generation=generation,
                        due_at=timescale.after(RetryPolicy.for_channel(channel).delay_s(1)),
                        lease_owner="", lease_expires_at=None)
            return "cancel_retry"
    still_running = []
    for job in open_jobs:
        VendorJob.objects.filter(pk=job.pk).update(cancel_requested_at=job.cancel_requested_at or timezone.now())
        status = cancel_vendor_job(job, vendor if vendor is not None and job.channel_id == channel.name else None)
        if status not in ("canceled", "completed", "failed", "gone"):
            still_running.append(job)
    if still_running:
        # The vendor cannot stop at once: keep tracking; the budget slot stays taken meanwhile.
        task_update(task.pk, state=S.CANCEL_REQUESTED, generation=generation,
                    due_at=timescale.after(PollPolicy.for_channel(channel).initial_s), lease_owner="", lease_expires_at=None)
        return "waiting_for_vendor"
    task_move(
        task.pk, source=S.CANCEL_REQUESTED, target=S.CANCELLED, generation=generation, actor=actor(),
        reason="cancel confirmed: no vendor job is running for this task",
        fields=dict(lease_owner="", lease_expires_at=None, vendor_job=task.vendor_job),
        attempt_outcome=Attempt.Outcome.CANCELLED,
    )
    return "cancelled"
