"""Channels as the dispatcher sees them: which are up and how much budget each has free.

Reads only: the breaker's state and the budget rows. Deciding to dispatch (and writing it) is the
dispatcher's job (tasks/services/dispatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import connections, router

from tasks import counters
from tasks.models import ChannelHealth, Lane, Task, VendorChannel
from tasks.rows import select
from tasks.scheduling.budgets import lane_rows, released_after, usage_of, usage_sql
from tasks.vendors import breaker
from tasks.vendors.dialects import capabilities_for
from tasks.vendors.policies import BreakerPolicy

B = ChannelHealth.Breaker
_NAME = VendorChannel._meta.pk.column


def serves(channel: VendorChannel, kind: str) -> bool:
    """The channel is configured for this kind of work and its vendor's dialect can do it."""
    return kind in (channel.kinds or []) and kind in capabilities_for(channel).kinds


@dataclass
class ChannelRoom:
    channel: VendorChannel
    available: bool
    free_jobs: int
    free_uploads: int
    trials_left: int | None = None
    free_by_row: dict[str, int] = field(default_factory=dict)  # the channel's per-lane rows

    def fits(self, lane: str = "interactive") -> bool:
        # The last job and upload slots are kept for the interactive lane (article 001's reserved
        # capacity): a batch flood waiting for its workers must not hold every upload slot. Where
        # the channel has per-lane rows, the job slots are kept inside the row interactive shares
        # (a heavy or risky document has its own row and never takes an interactive converter).
        kept = 0 if lane == "interactive" else self.channel.reserved_for_interactive
        rows = lane_rows(self.channel.lane_slots)
        jobs_kept = 0 if rows else min(kept, self.channel.max_inflight_jobs // 2)
        uploads_kept = min(kept, self.channel.max_concurrent_uploads // 2)
        if not self.available or self.free_jobs - jobs_kept <= 0 or self.free_uploads - uploads_kept <= 0:
            return False
        for key, (lanes, limit) in rows.items():
            if lane not in lanes:
                continue
            row_kept = min(kept, limit // 2) if "interactive" in lanes else 0
            if self.free_by_row.get(key, limit) - row_kept <= 0:
                return False  # its lane's row is full (heavy documents have their own converters)
        return self.trials_left is None or self.trials_left > 0

    def take(self, lane: str = "interactive") -> None:
        self.free_jobs -= 1
        self.free_uploads -= 1
        for key in self._rows_of(lane):
            self.free_by_row[key] = self.free_by_row.get(key, 0) - 1
        if self.trials_left is not None:
            self.trials_left -= 1

    def _rows_of(self, lane: str) -> list[str]:
        return [key for key, (lanes, _) in lane_rows(self.channel.lane_slots).items() if lane in lanes]


def channel_rooms() -> dict[str, ChannelRoom]:
    """Every enabled channel's room, read fresh in one statement whatever the number of channels:
    the channels with their health and their usage."""
    return _rooms(_enabled_channels())


def rooms_with_lane(lane_name: str) -> tuple[dict[str, ChannelRoom], Lane | None, dict[Any, dict[str, int]]]:
    """channel_rooms, and the lane read fresh with its counts by tenant (as
    counters.lane_with_counts_by_tenant gives them), in one statement: each channel's row
    carries the lane's (read alone when no channel is enabled). Admission reads both under its
    lock."""
    alias = router.db_for_read(VendorChannel)
    row, loads = counters.lane_json_sql(alias)
    channels = _enabled_channels({"lane_row": row, "lane_loads": loads}, [(None, lane_name), (None, lane_name)])
    if not channels:
        lane, counts = counters.lane_with_counts_by_tenant(lane_name)
        return {}, lane, counts
    lane, counts = counters.lane_from_json(alias, channels[0].lane_row, channels[0].lane_loads)
    return _rooms(channels), lane, counts


def _enabled_channels(extra: dict[str, str] | None = None, params: list | None = None) -> list[VendorChannel]:
    """The enabled channels in order, each with its health and its usage (and `extra` columns,
    `params` theirs)."""
    alias = router.db_for_read(VendorChannel)
    return select(VendorChannel, "t.enabled = %s ORDER BY t.preference, t.name",
                  [(None, released_after(connections[alias])), *(params or []), ("enabled", True)],
                  related=("health",), extra={"usage": usage_sql(alias, f"t.{connections[alias].ops.quote_name(_NAME)}"),
                                              **(extra or {})})


def _rooms(channels: list[VendorChannel]) -> dict[str, ChannelRoom]:
    rooms: dict[str, ChannelRoom] = {}
    for channel in channels:
        joined = getattr(channel, "health", None)  # read with the channel, as fresh as health_for's
        health = breaker.seen(channel, joined) if joined else breaker.health_for(channel)
        usage = usage_of(channel.usage)
        available = breaker.is_available(channel, health)
        trials = None
        if health.breaker_state in (B.OPEN, B.HALF_OPEN):
            used = health.half_open_permits_used if health.breaker_state == B.HALF_OPEN else 0
            trials = max(BreakerPolicy.for_channel(channel).half_open_calls - used, 0)
        rooms[channel.name] = ChannelRoom(
            channel=channel, available=available, free_jobs=usage.free_jobs(channel),
            free_uploads=usage.free_uploads(channel), trials_left=trials, free_by_row=usage.free_by_row(channel),
        )
    return rooms


def pick_channel(task: Task, rooms: dict[str, ChannelRoom]) -> ChannelRoom | None:
    """The task's channel, or the next healthy one with room.

    A QUEUED task either has no vendor operation yet, or one that was proven not processed (a
    not-processed failure, or a reconciliation that found nothing), so moving it elsewhere can
    not create a second billed job.
    """
    ordered = sorted(rooms.values(), key=lambda r: (r.channel.preference, r.channel.name))
    preferred = [r for r in ordered if r.channel.name == task.channel_id]
    candidates = preferred + [r for r in ordered if r.channel.name != task.channel_id]
    for room in candidates:
        if not serves(room.channel, task.kind) or room.channel.name in (task.abandoned_channels or []):
            continue
        if room.fits(task.lane_id or "interactive"):
            return room
    return None


def channels_down_for(task: Task, rooms: dict[str, ChannelRoom]) -> bool:
    """No channel that could take this task (its kind, not abandoned by it) is up."""
    usable = [r for r in rooms.values() if serves(r.channel, task.kind)
              and r.channel.name not in (task.abandoned_channels or [])]
    return not any(r.available for r in usable)
