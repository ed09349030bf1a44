"""Numbers for the dashboard (selectors) and the small server-rendered SVG charts that show them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from html import escape
from typing import Any

from django.db.models import Count, Min, Q, Sum
from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe

from console.history import history_context
from tasks.models import (
    ChannelHealth,
    Lane,
    Task,
    TaskEvent,
    Tenant,
    VendorCall,
    VendorChannel,
    VendorJob,
)
from tasks.scheduling.budgets import channel_usage
from tasks.scheduling.quotas import WAITING_STATES, quota_effective, tenant_running
from tasks.states import IN_FLIGHT_STATES, State

WINDOW = timedelta(hours=1)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 2)


@dataclass
class LaneStats:
    lane: Lane
    queued: int
    running: int
    oldest_wait_s: float | None
    finished_per_min: list[int] = field(default_factory=list)
    throughput_per_min: float = 0.0
    queue_wait_p50: float | None = None
    queue_wait_p95: float | None = None
    run_p50: float | None = None
    run_p95: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    error_rate: float = 0.0


def lane_stats(now=None) -> list[LaneStats]:
    now = now or timezone.now()
    since = now - WINDOW
    stats = []
    for lane in Lane.objects.order_by("dispatch_order"):
        tasks = Task.objects.filter(lane=lane)
        waiting = tasks.filter(Q(state=State.QUEUED, dispatched_at__isnull=True) | Q(state=State.ACCEPTED, deferred=True))
        running = tasks.filter(Q(state__in=IN_FLIGHT_STATES) | Q(state=State.QUEUED, dispatched_at__isnull=False)).count()
        oldest = waiting.aggregate(m=Min("queued_at"))["m"]
        item = LaneStats(lane=lane, queued=waiting.count(), running=running,
                         oldest_wait_s=round((now - oldest).total_seconds(), 1) if oldest else None)
        finished = tasks.filter(finished_at__gte=since)
        buckets = Counter(int((now - t).total_seconds() // 60) for t in finished.filter(state=State.SUCCEEDED)
                          .values_list("finished_at", flat=True))
        item.finished_per_min = [buckets.get(i, 0) for i in range(29, -1, -1)]
        item.throughput_per_min = round(sum(item.finished_per_min[-5:]) / 5, 2)
        waits, runs = _durations(lane, since)
        item.queue_wait_p50, item.queue_wait_p95 = _percentile(waits, 0.5), _percentile(waits, 0.95)
        item.run_p50, item.run_p95 = _percentile(runs, 0.5), _percentile(runs, 0.95)
        ended = finished.exclude(state=State.SUCCEEDED)
        item.errors = dict(ended.values_list("error_code").annotate(n=Count("id")).order_by("-n")[:5])
        total = finished.count()
        item.error_rate = round(ended.count() / total, 3) if total else 0.0
        stats.append(item)
    return stats


def _durations(lane: Lane, since) -> tuple[list[float], list[float]]:
    """Queue waits (QUEUED → RUNNING) and run times (RUNNING → end) of the last hour, sampled."""
    events = (
        TaskEvent.objects.filter(task__lane=lane, at__gte=since, to_state__in=[State.QUEUED, State.RUNNING, State.SUCCEEDED, State.FAILED, State.RETRY_WAIT])
        .order_by("task_id", "at").values_list("task_id", "to_state", "at")[:5000]
    )
    waits, runs = [], []
    queued_at: dict[Any, Any] = {}
    started_at: dict[Any, Any] = {}
    for task_id, state, at in events:
        if state == State.QUEUED:
            queued_at[task_id] = at
        elif state == State.RUNNING and task_id in queued_at:
            waits.append((at - queued_at.pop(task_id)).total_seconds())
            started_at[task_id] = at
        elif task_id in started_at:
            runs.append((at - started_at.pop(task_id)).total_seconds())
    return waits, runs


@dataclass
class ChannelStats:
    channel: VendorChannel
    health: ChannelHealth
    jobs: int
    uploads: int
    rate_limited_15m: int
    calls_15m: int
    failures_15m: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    held: int = 0  # tasks of this channel waiting (queued, retrying, reconciling)
    lane_free: dict[str, int] = field(default_factory=dict)  # free jobs of each per-lane row

    @property
    def failing(self) -> bool:
        return self.channel.enabled and self.health.breaker_state in ("OPEN", "HALF_OPEN", "FORCED_OPEN")


HELD_STATES = ("QUEUED", "RETRY_WAIT", "RECONCILING")


def channel_stats(now=None) -> list[ChannelStats]:
    now = now or timezone.now()
    result = []
    for channel in VendorChannel.objects.all():
        from tasks.vendors.breaker import health_for

        health = health_for(channel)
        usage = channel_usage(channel)
        recent = VendorCall.objects.filter(channel=channel, at__gte=now - timedelta(minutes=15))
        durations = list(recent.filter(operation="get_job", outcome="ok").order_by("-id").values_list("duration_ms", flat=True)[:500])
        result.append(ChannelStats(
            channel=channel, health=health, jobs=usage.jobs, uploads=usage.uploads,
            rate_limited_15m=recent.filter(status_code=429).count(), calls_15m=recent.count(),
            failures_15m=recent.filter(breaker_failure=True).count(),
            latency_p50_ms=_percentile(durations, 0.5), latency_p95_ms=_percentile(durations, 0.95),
            held=Task.objects.filter(channel=channel, state__in=HELD_STATES).exclude(
                state="QUEUED", dispatched_at__isnull=False).count(),
            lane_free=usage.free_by_row(channel),
        ))
    return result


@dataclass
class TenantStats:
    tenant: Tenant
    queued: int
    running: int
    submitted_1m: int
    bytes_24h: int
    quota: Any


def tenant_stats(now=None) -> list[TenantStats]:
    now = now or timezone.now()
    result = []
    for tenant in Tenant.objects.all()[:50]:
        tasks = Task.objects.filter(tenant=tenant)
        result.append(TenantStats(
            tenant=tenant, queued=tasks.filter(state__in=WAITING_STATES).count(), running=tenant_running(tenant.pk),
            submitted_1m=tasks.filter(created_at__gte=now - timedelta(minutes=1)).count(),
            bytes_24h=tasks.filter(created_at__gte=now - timedelta(days=1)).aggregate(s=Sum("file__size"))["s"] or 0,
            quota=quota_effective(tenant, now=now),
        ))
    return result


def state_counts() -> dict[str, int]:
    counts = dict(Task.objects.values_list("state").annotate(n=Count("id")))
    return {state: counts.get(state, 0) for state in State.values}


# --- SVG ------------------------------------------------------------------------------------------------
def sparkline(values: list[int], *, width: int = 160, height: int = 32, label: str = "") -> SafeString:
    """A line of the last minutes; colors come from the admin's theme variables."""
    top = max(values) or 1
    step = width / max(len(values) - 1, 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values))
    title = escape(label or f"max {top}/min")
    return mark_safe(
        f'<svg class="spark" role="img" aria-label="{title}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        f"<title>{title}</title>"
        f'<polyline fill="none" stroke="var(--primary, #417690)" stroke-width="1.5" points="{points}"/></svg>'
    )


def meter(value: float, limit: float | None, *, width: int = 160, label: str = "") -> SafeString:
    """A horizontal bar of value against its limit (budget, quota); red at or over the limit."""
    height = 14
    if not limit:
        ratio = 0.0 if not value else 1.0
        text = f"{value:g} (no limit)"
    else:
        ratio = min(value / limit, 1.0)
        text = f"{value:g} / {limit:g}"
    color = "var(--error-fg, #ba2121)" if limit and value >= limit else "var(--primary, #417690)"
    title = escape(f"{label} {text}".strip())
    return mark_safe(
        f'<svg class="meter" role="img" aria-label="{title}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        f"<title>{title}</title>"
        f'<rect width="{width}" height="{height}" rx="3" fill="var(--hairline-color, #ddd)"/>'
        f'<rect width="{width * ratio:.1f}" height="{height}" rx="3" fill="{color}"/>'
        f'<text x="4" y="11" font-size="10" fill="var(--body-fg, #333)">{escape(text)}</text></svg>'
    )


def bars(pairs: list[tuple[str, int]], *, width: int = 380, row: int = 18) -> SafeString:
    """Labelled horizontal bars (tasks by state, by lane)."""
    top = max([v for _, v in pairs] + [1])
    height = row * len(pairs)
    parts = [f'<svg class="bars" role="img" aria-label="counts" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for index, (label, value) in enumerate(pairs):
        y = index * row
        length = (width - 190) * value / top
        parts.append(f'<text x="0" y="{y + 13}" font-size="11" fill="var(--body-fg, #333)">{escape(label)}</text>')
        parts.append(f'<rect x="150" y="{y + 3}" width="{length:.1f}" height="{row - 6}" rx="2" fill="var(--primary, #417690)"/>')
        parts.append(f'<text x="{154 + length:.1f}" y="{y + 13}" font-size="11" fill="var(--body-quiet-color, #666)">{value}</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))


def dashboard_context() -> dict[str, Any]:
    lanes = lane_stats()
    states = state_counts()
    channels = channel_stats()
    history = history_context()
    return {
        "lanes": lanes,
        "channels": channels,
        "outages": [c for c in channels if c.failing],
        "tenants": tenant_stats(),
        "states_chart": bars([(s, n) for s, n in states.items()]),
        "lanes_chart": bars([(f"{l.lane.name} queued", l.queued) for l in lanes] + [(f"{l.lane.name} running", l.running) for l in lanes]),
        "live_jobs": VendorJob.objects.filter(terminal_at__isnull=True).count(),
        "history": history,
        "history_windows": [("1h", "hour", history["1h"]), ("24h", "24 hours", history["24h"])],
        "generated_at": timezone.now(),
    }


def _channel_meters(self: ChannelStats) -> dict[str, Any]:
    from tasks.scheduling.budgets import lane_rows

    return {
        "jobs": meter(self.jobs, self.channel.max_inflight_jobs, label="in-flight jobs"),
        "uploads": meter(self.uploads, self.channel.max_concurrent_uploads, label="uploads"),
        "lanes": [(key, meter(limit - self.lane_free.get(key, limit), limit, width=110, label=f"{key} jobs"))
                  for key, (_, limit) in lane_rows(self.channel.lane_slots).items()],
    }


def _tenant_meters(self: TenantStats) -> dict[str, SafeString]:
    q = self.quota
    return {
        "queued": meter(self.queued, q.max_queued, label="queued"),
        "running": meter(self.running, q.max_running, label="running"),
        "rate": meter(self.submitted_1m, q.submissions_per_minute, label="submissions/min"),
        "bytes": meter(round(self.bytes_24h / 1e6, 1), round(q.bytes_per_day / 1e6, 1) if q.bytes_per_day else None, label="MB/day"),
    }


def _lane_meters(self: LaneStats) -> dict[str, SafeString]:
    return {
        "queued": meter(self.queued, self.lane.max_queued, label="queued"),
        "running": meter(self.running, self.lane.max_running, label="running"),
    }


ChannelStats.meters = property(_channel_meters)
TenantStats.meters = property(_tenant_meters)
LaneStats.meters = property(_lane_meters)
LaneStats.sparkline = property(
    lambda self: sparkline(self.finished_per_min, label=f"{self.lane.name}: succeeded per minute, last 30 min")
)
