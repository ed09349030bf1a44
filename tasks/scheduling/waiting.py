"""Why a task is not moving (selectors: reads only)."""

from __future__ import annotations

from tasks.models import Task
from tasks.scheduling import quotas
from tasks.scheduling.channels import channel_rooms, serves
from tasks.scheduling.lanes import lane_running
from tasks.states import State


def waiting_reason(task: Task) -> str | None:
    """Why a task is not moving: stored with the move into RETRY_WAIT or RECONCILING (or a result
    download waiting to be retried), derived for ACCEPTED and QUEUED work (tenant_at_quota |
    lane_full | vendor_budget | breaker_open | fair_share ...)."""
    if task.state == State.ACCEPTED:
        return "lane_full" if task.deferred else "precheck"
    if task.state == State.RETRY_WAIT:
        return task.waiting_reason or "retry_backoff"
    if task.state == State.RECONCILING:
        return task.waiting_reason or "reconciling"
    if task.state == State.RUNNING and task.phase == Task.Phase.FETCH and task.waiting_reason and task.fetch_attempts:
        return task.waiting_reason
    if task.state != State.QUEUED or task.dispatched_at is not None:
        return None
    lane = task.lane
    if lane is None:
        return "precheck"
    if lane.paused:
        return "lane_paused"
    running = lane_running(lane).count()
    if running >= lane.max_running:
        return "lane_full"
    limit = quotas.quota_effective(task.tenant).max_running
    if limit is not None and quotas.tenant_running(task.tenant_id) >= limit:
        return "tenant_at_quota"
    rooms = [
        r for r in channel_rooms().values()
        if serves(r.channel, task.kind) and r.channel.name not in (task.abandoned_channels or [])
    ]
    if rooms and not any(r.available for r in rooms):
        return "breaker_open"
    if not any(r.fits(task.lane_id) for r in rooms):
        return "vendor_budget"
    return "fair_share"
