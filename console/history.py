"""The dashboard's history: the last hour per minute and the last 24 hours per half hour, read from
the rollup (tasks/services/history.py) and drawn as server-side SVG (no script, no CDN)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from html import escape

from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe

from tasks.models import HistoryMinute
from tasks.services.history import floor_minute

WINDOWS = {"1h": (timedelta(hours=1), 1), "24h": (timedelta(hours=24), 30)}  # span, minutes per bucket
CLASS_COLORS = {"vendor": "#c0392b", "deadline": "#d68910", "input": "#7d3c98", "capacity": "#2874a6",
                "internal": "#566573", "engine": "#117a65", "unknown": "#979a9a"}


@dataclass
class Bucket:
    start: datetime
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    wait_p95_s: float | None = None  # the worst minute's p95 in the bucket
    vendor_p95_ms: float | None = None
    errors: Counter = field(default_factory=Counter)


def buckets(window: str, *, scope: str = "all", key: str = "", now: datetime | None = None) -> list[Bucket]:
    span, size = WINDOWS[window]
    now = now or timezone.now()
    end = floor_minute(now) + timedelta(minutes=1)
    first = end - span
    # Buckets align on the clock (a half hour starts at :00 or :30).
    first = first - timedelta(minutes=first.minute % size)
    count = -(-int((end - first).total_seconds() // 60) // size)  # the last bucket may be partial
    result = [Bucket(start=first + timedelta(minutes=i * size)) for i in range(count)]
    rows = HistoryMinute.objects.filter(scope=scope, key=key, minute__gte=first, minute__lt=end).order_by("minute")
    for row in rows:
        index = int((row.minute - first).total_seconds() // 60 // size)
        if not 0 <= index < len(result):
            continue
        bucket = result[index]
        bucket.submitted += row.submitted
        bucket.succeeded += row.succeeded
        bucket.failed += row.failed
        bucket.retried += row.retried
        bucket.errors.update(row.errors or {})
        if row.wait_p95_s is not None:
            bucket.wait_p95_s = max(bucket.wait_p95_s or 0.0, row.wait_p95_s)
        if row.vendor_p95_ms is not None:
            bucket.vendor_p95_ms = max(bucket.vendor_p95_ms or 0.0, row.vendor_p95_ms)
    return result


def _frame(name: str, label: str, width: int, height: int) -> list[str]:
    return [f'<svg class="history" data-chart="{name}" role="img" aria-label="{escape(label)}" width="100%" '
            f'viewBox="0 0 {width} {height}" preserveAspectRatio="none"><title>{escape(label)}</title>',
            f'<line x1="0" y1="{height - 14}" x2="{width}" y2="{height - 14}" stroke="var(--hairline-color, #ccc)"/>']


def _axis(parts: list[str], series: list[Bucket], width: int, height: int, step: float) -> None:
    for index in (0, len(series) // 2, len(series) - 1):
        if 0 <= index < len(series):
            x = min(index * step, width - 34)
            parts.append(f'<text x="{x:.1f}" y="{height - 2}" font-size="10" fill="var(--body-quiet-color, #666)">'
                         f'<tspan data-when-hm="{series[index].start.isoformat()}">{series[index].start:%H:%M}</tspan></text>')


def throughput(series: list[Bucket], name: str, *, width: int = 600, height: int = 120) -> SafeString:
    """Succeeded (blue) and failed (red) per bucket, stacked; each column carries its numbers."""
    top = max([b.succeeded + b.failed for b in series] + [1])
    step = width / max(len(series), 1)
    plot = height - 18
    parts = _frame(name, f"tasks finished per bucket (max {top})", width, height)
    for index, bucket in enumerate(series):
        x = index * step
        ok_h = plot * bucket.succeeded / top
        bad_h = plot * bucket.failed / top
        title = f"{bucket.start:%H:%M} UTC: {bucket.succeeded} succeeded, {bucket.failed} failed, {bucket.retried} retried, {bucket.submitted} submitted"
        parts.append(f'<g data-bucket="{bucket.start.isoformat()}" data-succeeded="{bucket.succeeded}" data-failed="{bucket.failed}" '
                     f'data-submitted="{bucket.submitted}"><title>{escape(title)}</title>'
                     f'<rect x="{x:.1f}" y="{plot - ok_h:.1f}" width="{max(step - 1, 0.5):.1f}" height="{ok_h:.1f}" fill="var(--primary, #417690)"/>'
                     f'<rect x="{x:.1f}" y="{plot - ok_h - bad_h:.1f}" width="{max(step - 1, 0.5):.1f}" height="{bad_h:.1f}" fill="var(--error-fg, #ba2121)"/></g>')
    _axis(parts, series, width, height, step)
    parts.append("</svg>")
    return mark_safe("".join(parts))


def wait_line(series: list[Bucket], name: str, *, width: int = 600, height: int = 90) -> SafeString:
    """p95 queue wait per bucket (the worst minute's, for buckets longer than a minute)."""
    values = [b.wait_p95_s for b in series]
    top = max([v for v in values if v is not None] + [0.001])
    step = width / max(len(series) - 1, 1)
    plot = height - 18
    parts = _frame(name, f"p95 queue wait (max {top:.2f} s)", width, height)
    points = []
    for index, (bucket, value) in enumerate(zip(series, values)):
        if value is None:
            continue
        x, y = index * step, plot - plot * value / top
        points.append(f"{x:.1f},{y:.1f}")
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.8" data-bucket="{bucket.start.isoformat()}" data-wait-p95="{value}" '
                     f'fill="var(--primary, #417690)"><title>{bucket.start:%H:%M} UTC: p95 wait {value:.2f} s</title></circle>')
    if points:
        parts.append(f'<polyline fill="none" stroke="var(--primary, #417690)" stroke-width="1.5" points="{" ".join(points)}"/>')
    parts.append(f'<text x="2" y="10" font-size="10" fill="var(--body-quiet-color, #666)">{top:.2f} s</text>')
    _axis(parts, series, width, height, step if len(series) > 1 else width)
    parts.append("</svg>")
    return mark_safe("".join(parts))


def error_classes(series: list[Bucket]) -> list[tuple[str, int, str]]:
    totals: Counter = Counter()
    for bucket in series:
        totals.update(bucket.errors)
    return [(name, n, CLASS_COLORS.get(name, "#979a9a")) for name, n in totals.most_common()]


def history_context(now: datetime | None = None) -> dict:
    now = now or timezone.now()
    context = {}
    for window in WINDOWS:
        series = buckets(window, now=now)
        context[window] = {
            "throughput": throughput(series, f"throughput-{window}"),
            "wait": wait_line(series, f"wait-{window}"),
            "errors": error_classes(series),
            "totals": {
                "submitted": sum(b.submitted for b in series), "succeeded": sum(b.succeeded for b in series),
                "failed": sum(b.failed for b in series), "retried": sum(b.retried for b in series),
            },
        }
    scopes = HistoryMinute.objects.filter(minute__gte=now - timedelta(hours=24)).exclude(scope="all")
    by_scope: dict[tuple[str, str], Counter] = {}
    for scope, key, submitted, succeeded, failed, retried in scopes.values_list(
            "scope", "key", "submitted", "succeeded", "failed", "retried"):
        totals = by_scope.setdefault((scope, key), Counter())
        totals.update({"submitted": submitted, "succeeded": succeeded, "failed": failed, "retried": retried})
    context["by_scope"] = sorted(((scope, key, dict(t)) for (scope, key), t in by_scope.items()))
    return context
