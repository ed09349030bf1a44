"""Channel budgets held across every process: concurrent uploads and in-flight vendor jobs.

A task reserves a job slot and an upload slot when it is dispatched. The upload slot is released
when its upload ends; the job reservation is released once a VendorJob row exists (which then
holds the budget until the job is confirmed terminal) or once it is proven no job was created.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from tasks.models import BudgetSlot, Task, VendorChannel, VendorJob

JOB, UPLOAD = BudgetSlot.Kind.JOB, BudgetSlot.Kind.UPLOAD


@dataclass(frozen=True)
class ChannelUsage:
    jobs: int
    uploads: int

    def free_jobs(self, channel: VendorChannel) -> int:
        return channel.max_inflight_jobs - self.jobs

    def free_uploads(self, channel: VendorChannel) -> int:
        return channel.max_concurrent_uploads - self.uploads


def _open_slots(channel: VendorChannel):
    # A slot released "in the future" is still held: an aborted upload may still be draining.
    return BudgetSlot.objects.filter(channel=channel).filter(Q(released_at__isnull=True) | Q(released_at__gt=timezone.now()))


def channel_usage(channel: VendorChannel) -> ChannelUsage:
    open_slots = _open_slots(channel)
    reserved_jobs = open_slots.filter(kind=JOB).count()
    live_jobs = VendorJob.objects.filter(channel=channel, terminal_at__isnull=True).count()
    uploads = open_slots.filter(kind=UPLOAD).count()
    return ChannelUsage(jobs=reserved_jobs + live_jobs, uploads=uploads)


def slots_reserve(task: Task, channel: VendorChannel) -> None:
    """Called by the dispatcher under its lock, after checking channel_usage()."""
    BudgetSlot.objects.bulk_create(
        [BudgetSlot(channel=channel, kind=JOB, task=task), BudgetSlot(channel=channel, kind=UPLOAD, task=task)]
    )


def slots_release(task_id, *kinds: str, reason: str, hold_s: float = 0.0) -> int:
    """Release the task's open slots now, or `hold_s` real seconds from now."""
    return BudgetSlot.objects.filter(task_id=task_id, kind__in=kinds or (JOB, UPLOAD), released_at__isnull=True).update(
        released_at=timezone.now() + timedelta(seconds=hold_s), release_reason=reason[:100]
    )


def vendor_job_terminal(job: VendorJob, status: str) -> bool:
    """Confirm a vendor job ended: its budget slot is free from now on."""
    return bool(
        VendorJob.objects.filter(pk=job.pk, terminal_at__isnull=True).update(status=status, terminal_at=timezone.now())
    )
