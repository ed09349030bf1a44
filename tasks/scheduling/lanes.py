"""Lanes: which lane a task belongs to, and the lanes every installation starts with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Q, QuerySet

from tasks import counters
from tasks.models import Lane, Task
from tasks.scheduling.channels import rooms_with_lane
from tasks.states import IN_FLIGHT_STATES, State

INTERACTIVE, BATCH, HEAVY, UNKNOWN_RISK = "interactive", "batch", "heavy", "unknown-risk"

# Admission closes early (before max_queued) at early_close_pct of the backlog, or while the
# oldest queued task has waited past oldest_wait_limit_s (half the queue deadline: a lane that far
# behind cannot keep its promise to new work either). busy_close_pct, the seed's active-worker
# gate, is off by default. urgency_s: a task this close to its deadline goes before fair share.
_TIMEOUT = settings.LANE_EXECUTION_TIMEOUT_S
DEFAULT_LANES: dict[str, dict[str, Any]] = {
    INTERACTIVE: dict(max_running=20, max_queued=500, queue_deadline_s=300, execution_timeout_s=_TIMEOUT[INTERACTIVE],
                      overflow_policy=Lane.Overflow.REJECT, early_close_pct=100, aging_s=30, dispatch_order=10,
                      urgency_s=60, oldest_wait_limit_s=150),
    BATCH: dict(max_running=20, max_queued=20000, queue_deadline_s=6 * 3600, execution_timeout_s=_TIMEOUT[BATCH],
                overflow_policy=Lane.Overflow.DEFER, early_close_pct=80, aging_s=120, dispatch_order=30,
                urgency_s=600, oldest_wait_limit_s=3 * 3600),
    HEAVY: dict(max_running=4, max_queued=2000, queue_deadline_s=12 * 3600, execution_timeout_s=_TIMEOUT[HEAVY],
                overflow_policy=Lane.Overflow.REJECT, early_close_pct=100, aging_s=300, dispatch_order=20,
                urgency_s=900, oldest_wait_limit_s=6 * 3600),
    UNKNOWN_RISK: dict(max_running=4, max_queued=2000, queue_deadline_s=6 * 3600, execution_timeout_s=_TIMEOUT[UNKNOWN_RISK],
                       overflow_policy=Lane.Overflow.REJECT, early_close_pct=100, aging_s=300, dispatch_order=40,
                       urgency_s=600, oldest_wait_limit_s=3 * 3600),
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


# A task holds one of its lane's slots while in flight, or once dispatched and about to start;
# it waits for one while queued and not yet dispatched.
HOLDING_SLOT = Q(state__in=IN_FLIGHT_STATES) | Q(state=State.QUEUED, dispatched_at__isnull=False)
WAITING_FOR_SLOT = Q(state=State.QUEUED, dispatched_at__isnull=True)
# The states any lane count looks at: a condition the (lane, state, dispatched_at) index can
# search, so a count reads the lane's live tasks, never its finished history.
LIVE_STATES = (State.ACCEPTED, State.QUEUED, *IN_FLIGHT_STATES)


def live_in_lane(lane: Lane) -> QuerySet[Task]:
    return Task.objects.filter(lane=lane, state__in=LIVE_STATES)


def lane_running(lane: Lane) -> QuerySet[Task]:
    """The lane's tasks holding a slot: in flight, or dispatched and about to start."""
    return Task.objects.filter(lane=lane).filter(HOLDING_SLOT)


def lane_slots_by_tenant(lane: Lane) -> dict:
    """tenant → (tasks holding a slot of the lane, tasks waiting for one), from the lane's
    counter rows (a row per tenant, whatever the backlog)."""
    return _slots(counters.lane_counts_by_tenant(lane.pk))


def lane_with_slots_and_rooms(name: str) -> tuple[Lane | None, dict, dict]:
    """The lane read fresh with its `lane_slots_by_tenant`, and every channel's room
    (channels.channel_rooms), in one statement."""
    rooms, lane, counts = rooms_with_lane(name)
    return lane, _slots(counts), rooms


def _slots(counts: dict) -> dict:
    return {tenant: (n["dispatched"] + n["in_flight"], n["queued"]) for tenant, n in counts.items()}
