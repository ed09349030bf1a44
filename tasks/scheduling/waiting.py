"""Why a task is not moving (selectors: reads only)."""

from __future__ import annotations

from tasks.models import Task
from tasks.scheduling import quotas
from tasks.scheduling.channels import channel_rooms, serves
from tasks.scheduling.lanes import lane_running
from tasks.states import State


class _Shared:
    """What several tasks' reasons read in common, read once (a list page asks for many)."""

    def __init__(self) -> None:
        self._rooms = None
        self._lanes: dict[str, int] = {}
        self._tenants: dict[object, tuple[int | None, int]] = {}

    def rooms(self):
        if self._rooms is None:
            self._rooms = channel_rooms()
        return self._rooms

    def lane_running(self, lane) -> int:
        if lane.pk not in self._lanes:
            self._lanes[lane.pk] = lane_running(lane).count()
        return self._lanes[lane.pk]

    def tenant(self, task: Task) -> tuple[int | None, int]:
        if task.tenant_id not in self._tenants:
            limit = quotas.quota_effective(task.tenant).max_running
            self._tenants[task.tenant_id] = (limit, quotas.tenant_running(task.tenant_id) if limit is not None else 0)
        return self._tenants[task.tenant_id]


def waiting_reason(task: Task, shared: _Shared | None = None) -> str | None:
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
    shared = shared or _Shared()
    lane = task.lane
    if lane is None:
        return "precheck"
    if lane.paused:
        return "lane_paused"
    if shared.lane_running(lane) >= lane.max_running:
        return "lane_full"
    limit, running = shared.tenant(task)
    if limit is not None and running >= limit:
        return "tenant_at_quota"
    rooms = [
        r for r in shared.rooms().values()
        if serves(r.channel, task.kind) and r.channel.name not in (task.abandoned_channels or [])
    ]
    if rooms and not any(r.available for r in rooms):
        return "breaker_open"
    if not any(r.fits(task.lane_id) for r in rooms):
        return "vendor_budget"
    return "fair_share"


def waiting_reasons(tasks) -> dict[object, str | None]:
    """waiting_reason for many tasks, reading what they share once."""
    shared = _Shared()
    return {task.pk: waiting_reason(task, shared) for task in tasks}

