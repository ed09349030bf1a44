"""Lanes: which lane a task belongs to, and the lanes every installation starts with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Q, QuerySet

from tasks.models import Lane, Task
from tasks.states import IN_FLIGHT_STATES, State

INTERACTIVE, BATCH, HEAVY, UNKNOWN_RISK = "interactive", "batch", "heavy", "unknown-risk"

DEFAULT_LANES: dict[str, dict[str, Any]] = {
    INTERACTIVE: dict(max_running=20, max_queued=500, queue_deadline_s=300, execution_timeout_s=900,
                      overflow_policy=Lane.Overflow.REJECT, early_close_pct=100, aging_s=30, dispatch_order=10),
    BATCH: dict(max_running=20, max_queued=20000, queue_deadline_s=6 * 3600, execution_timeout_s=3600,
                overflow_policy=Lane.Overflow.DEFER, early_close_pct=80, aging_s=120, dispatch_order=30),
    HEAVY: dict(max_running=4, max_queued=2000, queue_deadline_s=12 * 3600, execution_timeout_s=4 * 3600,
                overflow_policy=Lane.Overflow.REJECT, early_close_pct=100, aging_s=300, dispatch_order=20),
    UNKNOWN_RISK: dict(max_running=4, max_queued=2000, queue_deadline_s=6 * 3600, execution_timeout_s=3600,
                       overflow_policy=Lane.Overflow.REJECT, early_close_pct=100, aging_s=300, dispatch_order=40),
}


def lanes_ensure() -> None:
    for name, defaults in DEFAULT_LANES.items():
        Lane.objects.get_or_create(name=name, defaults=defaults)


@dataclass(frozen=True)
class LaneRouting:
    """Thresholds that send a task to a lane; cost comes from the pre-check where known."""

    interactive_max_bytes: int = 25 * 1024 * 1024
    interactive_max_pages: int = 30
    interactive_max_minutes: float = 15
    heavy_min_bytes: int = 200 * 1024 * 1024
    heavy_min_pages: int = 300
    heavy_min_minutes: float = 90

    def lane_for(self, *, priority: str, size: int, findings: dict[str, Any] | None, released: bool = False) -> str:
        # Released quarantine and files the pre-check could not vouch for never enter hot lanes.
        if released or (findings and findings.get("risk") == "unknown"):
            return UNKNOWN_RISK
        pages = (findings or {}).get("pages") or 0
        minutes = (findings or {}).get("audio_minutes") or 0
        if size >= self.heavy_min_bytes or pages >= self.heavy_min_pages or minutes >= self.heavy_min_minutes:
            return HEAVY
        small = (
            size <= self.interactive_max_bytes
            and pages <= self.interactive_max_pages
            and minutes <= self.interactive_max_minutes
        )
        if priority == INTERACTIVE and small:
            return INTERACTIVE
        return BATCH


ROUTING = LaneRouting()


def lane_running(lane: Lane) -> QuerySet[Task]:
    """The lane's tasks holding a slot: in flight, or dispatched and about to start."""
    return Task.objects.filter(lane=lane).filter(Q(state__in=IN_FLIGHT_STATES) | Q(state=State.QUEUED, dispatched_at__isnull=False))


def lane_has_room(lane: Lane) -> bool:
    waiting = Task.objects.filter(lane=lane, state=State.QUEUED, dispatched_at__isnull=True).count()
    return waiting < lane.max_queued
