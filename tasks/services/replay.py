"""Replaying failed or expired work: the same task id, a new generation, never a new task."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from tasks import timescale
from tasks.models import DeadLetter, Lane, Quarantine, Task, VendorJob
from tasks.services.outcomes import task_move
from tasks.states import State


def replay_refusal(task: Task) -> str | None:
    """Why this task may not be replayed (None: it may)."""
    if task.state not in (State.FAILED, State.EXPIRED):
        return f"it is {task.state}, not FAILED or EXPIRED"
    if Quarantine.objects.filter(tenant_id=task.tenant_id, sha256=task.file.sha256, released_at__isnull=True,
                                 purged_at__isnull=True).exists():
        return "its file is quarantined (release it from the quarantine page)"
    if task.file.deleted_at is not None:
        return "its file was purged"
    return None


def task_replay(*, task: Task, actor: str, lane_name: str | None = None, params: dict[str, Any] | None = None) -> bool:
    """FAILED/EXPIRED → QUEUED with fresh deadlines; the vendor operation restarts clean."""
    if replay_refusal(task) is not None and not (lane_name == "unknown-risk" and task.error_code == "quarantined"):
        return False
    lane = Lane.objects.get(pk=lane_name) if lane_name else task.lane
    now = timezone.now()
    original = max((task.deadline_at - task.created_at).total_seconds(), timescale.seconds(60))
    queue_deadline_at = now + timescale.delta(lane.queue_deadline_s)
    deadline_at = now + timedelta_s(original)
    fields: dict[str, Any] = dict(
        lane=lane, queued_at=now, finished_at=None, due_at=None, dispatched_at=None, enqueued_at=None,
        queue_deadline_at=queue_deadline_at, deadline_at=deadline_at,
        dispatch_deadline_at=min(queue_deadline_at, deadline_at),
        error_code="", error_message="", error_retryable=False, channel_attempts=0, abandoned_channels=[],
        poll_interval_s=0, poll_deadline_at=None, vendor_job=None, phase="", lease_owner="", lease_expires_at=None,
        fetch_attempts=0, reconcile_rounds=0,
    )
    if params is not None:
        fields["params"] = {**task.params, **params}
    if not task.vendor_client_ref or VendorJob.objects.filter(task=task, client_ref=task.vendor_client_ref).exists():
        # The old operation produced a job (now over or being cancelled): start a new one. An
        # operation that never got an answer keeps its key, so the vendor would replay, not bill.
        fields.update(vendor_client_ref="", vendor_idempotency_key="", upload_id="", upload_expires_at=None, channel=None)
    moved = task_move(
        task.pk, source=task.state, target=State.QUEUED, generation=task.generation, actor=actor,
        reason=f"replayed by {actor}", fields=fields,
    )
    if moved:
        DeadLetter.objects.filter(task=task, resolved_at__isnull=True).update(
            resolved_at=now, resolution="replayed", resolved_by=actor[:150]
        )
    return moved is not None


def timedelta_s(seconds: float):
    return timedelta(seconds=seconds)
