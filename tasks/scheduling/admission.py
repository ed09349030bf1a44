"""Who gets the next free slot of a lane, as pure values (no database).

Order of precedence, for the head (first task) of each tenant's queue:
1. **Deadline first when it is near**: a head within the lane's `urgency_s` of its deadline (the
   earliest of its business and queue deadlines) goes first, earliest deadline first (seed 003:
   "promote the head of the queue as it nears its timeout").
2. **Aging lifts a starved tenant**: a tenant running less than its weighted share of the lane's
   running slots whose head waited past `aging_s` goes next, the longest-waiting first. A tenant
   already at or above its share is never lifted by aging: a flood's old tasks do not turn the
   lane into FIFO.
3. **Fair share**: the tenant with the fewest running tasks per unit of weight.
Within a tenant, tasks are taken earliest deadline first (their dispatch deadline, kept across
retries so a retry keeps its place), then in queue order.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Head:
    """The first task of one tenant's queue in the lane."""

    waited_s: float
    deadline_in_s: float


@dataclass(frozen=True)
class Share:
    """One tenant's standing in the lane."""

    running: int
    weight: float
    at_quota: bool = False


@dataclass(frozen=True)
class AdmissionPolicy:
    aging_s: float
    urgency_s: float

    def next_tenant(self, heads: Mapping[Hashable, Head], shares: Mapping[Hashable, Share]) -> Hashable | None:
        eligible = [t for t in heads if not shares[t].at_quota]
        if not eligible:
            return None
        urgent = [t for t in eligible if heads[t].deadline_in_s <= self.urgency_s]
        if urgent:
            return min(urgent, key=lambda t: heads[t].deadline_in_s)
        starved = [t for t in eligible if heads[t].waited_s > self.aging_s and self.below_share(t, shares)]
        if starved:
            return max(starved, key=lambda t: heads[t].waited_s)
        return min(eligible, key=lambda t: ((shares[t].running + 1) / shares[t].weight, heads[t].deadline_in_s))

    @staticmethod
    def admits_on_arrival(*, waiting: int, free: int, at_quota: bool) -> bool:
        """Whether a task arriving in the lane takes a free slot at once, without a pass over the
        lane: only when nothing else waits there (it would be a pass's only candidate, which
        `next_tenant` picks unless its tenant is at quota) and a slot is free."""
        return waiting == 0 and free > 0 and not at_quota

    @staticmethod
    def below_share(tenant: Hashable, shares: Mapping[Hashable, Share]) -> bool:
        """Running fewer than its weight's part of every slot the waiting tenants hold now."""
        total_running = sum(s.running for s in shares.values())
        total_weight = sum(s.weight for s in shares.values()) or 1.0
        return shares[tenant].running < shares[tenant].weight / total_weight * total_running


@dataclass(frozen=True)
class LaneLoad:
    """A lane as admission sees it when new work arrives (nominal seconds)."""

    waiting: int
    running: int
    oldest_wait_s: float


@dataclass(frozen=True)
class Gate:
    """What happens to new work: `open`, or closed (`full` at the backlog limit, `closing` before
    it) with the reason in words for the caller."""

    state: str
    reason: str = ""


def admission_gate(*, max_queued: int, max_running: int, early_close_pct: int, oldest_wait_limit_s: float | None,
                   busy_close_pct: int, load: LaneLoad) -> Gate:
    """Whether a lane takes new work now. It closes before its backlog is full when it reaches
    `early_close_pct` of it (seed 001: fail fast at 80 %), when its oldest queued task has waited
    past `oldest_wait_limit_s` (it is too far behind to keep a promise to new work), or when
    `busy_close_pct` of its slots are busy and work already waits (seed 003's active-worker gate)."""
    if load.waiting >= max_queued:
        return Gate("full", f"{load.waiting} tasks are waiting, the lane's limit")
    if early_close_pct < 100 and load.waiting >= max_queued * early_close_pct / 100:
        return Gate("closing", f"the backlog is at {early_close_pct}% of its limit ({load.waiting} of {max_queued})")
    if oldest_wait_limit_s is not None and load.waiting and load.oldest_wait_s > oldest_wait_limit_s:
        return Gate("closing", f"its oldest queued task has waited {load.oldest_wait_s:.0f}s, "
                               f"more than {oldest_wait_limit_s:.0f}s")
    if busy_close_pct and load.waiting and load.running >= max_running * busy_close_pct / 100:
        return Gate("closing", f"{load.running} of its {max_running} slots are busy and work is waiting")
    return Gate("open")
