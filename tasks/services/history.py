"""History at a glance: a per-minute rollup of the task table, kept for 7 days.

The dispatcher calls `history_rollup_due` on every tick; it recomputes the last few minutes at
most every ROLLUP_EVERY_S (the current minute included, so the dashboard is never more than that
behind), upserting one row per minute for everything, for each lane and for each channel. Rows
are derived from the task table, its events and the vendor calls, so recomputing is safe and
several dispatchers may do it at once.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.db.models import F, Max, QuerySet
from django.utils import timezone

from tasks.models import HistoryMinute, Task, TaskEvent, VendorCall
from tasks.states import State

KEEP = timedelta(days=7)
ROLLUP_EVERY_S = 15.0
RECOMPUTE_MINUTES = 3  # late writes (a task finishing just after its minute) are caught up
SAMPLE = 5000  # durations per minute used for the percentiles
CHUNK = 30  # minutes read together (a backfill of a day in 48 reads of each table, not 1,440)
VALUE_FIELDS = ("submitted", "succeeded", "failed", "retried", "wait_p50_s", "wait_p95_s", "vendor_p50_ms",
                "vendor_p95_ms", "errors")

# Failures by class, as the charts group them.
ERROR_CLASSES: dict[str, str] = {
    "quarantined": "input", "input_mismatch": "input", "unsupported_mode": "input",
    "deadline_exceeded": "deadline", "queue_deadline_exceeded": "deadline", "execution_timeout": "deadline",
    "shed": "capacity",
    "step_crashed": "internal", "worker_stopped": "internal", "lease_expired": "internal",
    "engine_timeout": "engine", "engine_cpu_exceeded": "engine", "engine_out_of_memory": "engine",
    "engine_crashed": "engine", "output_too_large": "engine", "unsupported_conversion": "input",
    "engine_input_invalid": "input",
}


def error_class(code: str) -> str:
    """The class of a failure: input, deadline, capacity, internal, engine or vendor (the rest)."""
    return ERROR_CLASSES.get(code or "", "vendor" if code else "unknown")


def floor_minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))], 3)


class _Minute:
    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.errors: Counter = Counter()
        self.waits: list[float] = []
        self.calls: list[float] = []


def minute_rows(start: datetime, minutes: int = 1) -> dict[datetime, dict[tuple[str, str], dict[str, Any]]]:
    """What happened in each of the `minutes` minutes from `start`, keyed by minute, then by
    (scope, key): four statements for them all (a backfill of a day reads in chunks of CHUNK)."""
    end = start + timedelta(minutes=minutes)
    groups: dict[datetime, dict[tuple[str, str], _Minute]] = defaultdict(lambda: defaultdict(_Minute))

    def scopes(at: datetime, lane: str | None, channel: str | None):
        minute = groups[floor_minute(at)]
        yield minute[("all", "")]
        if lane:
            yield minute[("lane", lane)]
        if channel:
            yield minute[("channel", channel)]

    # Submissions by their history entry (read by its time's index), not by the task's creation
    # time: an index on that would also tempt PostgreSQL to look for a lane's oldest waiting task
    # in creation order through every finished one.
    submitted = TaskEvent.objects.filter(at__gte=start, at__lt=end, to_state=State.ACCEPTED, from_state="")
    for at, lane, channel in submitted.values_list("at", "task__lane_id", "task__channel_id"):
        for group in scopes(at, lane, channel):
            group.counts["submitted"] += 1
    ended = TaskEvent.objects.filter(at__gte=start, at__lt=end, to_state__in=[State.SUCCEEDED, State.FAILED, State.EXPIRED,
                                                                                State.RETRY_WAIT])
    for at, state, lane, channel, code in ended.values_list("at", "to_state", "task__lane_id", "task__channel_id",
                                                            "task__error_code"):
        for group in scopes(at, lane, channel):
            if state == State.SUCCEEDED:
                group.counts["succeeded"] += 1
            elif state == State.RETRY_WAIT:
                group.counts["retried"] += 1
            else:
                group.counts["failed"] += 1
                group.errors[error_class(code)] += 1
    started = (Task.objects.filter(started_at__gte=start, started_at__lt=end, queued_at__isnull=False)
               .annotate(wait=F("started_at") - F("queued_at")).values_list("started_at", "lane_id", "channel_id", "wait"))
    for at, lane, channel, wait in _sampled(started, "started_at", start, minutes):
        for group in scopes(at, lane, channel):
            group.waits.append(max(wait.total_seconds(), 0.0))
    calls = VendorCall.objects.filter(at__gte=start, at__lt=end).values_list("at", "task__lane_id", "channel_id",
                                                                            "duration_ms")
    for at, lane, channel, duration in _sampled(calls, "at", start, minutes):
        for group in scopes(at, lane, channel):
            group.calls.append(float(duration))
    rows: dict[datetime, dict[tuple[str, str], dict[str, Any]]] = {}
    for back in range(minutes):
        minute = start + timedelta(minutes=back)
        rows[minute] = {scope_key: _values(group) for scope_key, group in groups.get(minute, {}).items()}
        rows[minute].setdefault(("all", ""), _values(_Minute()))
    return rows


def _sampled(rows: QuerySet, field: str, start: datetime, minutes: int) -> list[tuple]:
    """Up to SAMPLE rows of each minute (their first column is the moment): one read for the
    chunk when it holds no more than that on average, else one per minute (a busy chunk must not
    leave its later minutes without a sample)."""
    cap = SAMPLE * minutes
    found = list(rows[:cap + 1])
    if len(found) > cap:
        found = [row for back in range(minutes) for row in rows.filter(**{
            f"{field}__gte": start + timedelta(minutes=back), f"{field}__lt": start + timedelta(minutes=back + 1)})[:SAMPLE]]
    taken: Counter = Counter()
    sample = []
    for row in found:
        minute = floor_minute(row[0])
        if taken[minute] < SAMPLE:
            taken[minute] += 1
            sample.append(row)
    return sample


def _values(group: _Minute) -> dict[str, Any]:
    return {
        "submitted": group.counts["submitted"], "succeeded": group.counts["succeeded"],
        "failed": group.counts["failed"], "retried": group.counts["retried"],
        "wait_p50_s": _percentile(group.waits, 0.5), "wait_p95_s": _percentile(group.waits, 0.95),
        "vendor_p50_ms": _percentile(group.calls, 0.5), "vendor_p95_ms": _percentile(group.calls, 0.95),
        "errors": dict(group.errors),
    }


def history_rollup(now: datetime | None = None, *, minutes: int = RECOMPUTE_MINUTES) -> int:
    """Recompute the last `minutes` minutes (the current one included) and drop what is past KEEP."""
    now = now or timezone.now()
    first = floor_minute(now) - timedelta(minutes=minutes - 1)
    rows = []
    for offset in range(0, minutes, CHUNK):
        chunk = minute_rows(first + timedelta(minutes=offset), min(CHUNK, minutes - offset))
        rows += [HistoryMinute(minute=minute, scope=scope, key=key or "", **values)
                 for minute, scoped in chunk.items() for (scope, key), values in scoped.items()]
    # One upsert for all of them (a statement per batch, not a read and a write per row), in the
    # key's order: two dispatchers upserting at once lock the rows in the same order.
    rows.sort(key=lambda row: (row.minute, row.scope, row.key))
    HistoryMinute.objects.bulk_create(rows, update_conflicts=True, unique_fields=["minute", "scope", "key"],
                                      update_fields=[*VALUE_FIELDS, "computed_at"])
    HistoryMinute.objects.filter(minute__lt=now - KEEP).delete()
    return len(rows)


_last_rollup = 0.0


def history_rollup_due(now: datetime) -> int:
    """The dispatcher's call: a rollup at most every ROLLUP_EVERY_S in this process."""
    global _last_rollup
    if time.monotonic() - _last_rollup < ROLLUP_EVERY_S:
        return 0
    _last_rollup = time.monotonic()
    latest = HistoryMinute.objects.filter(scope=HistoryMinute.Scope.ALL).aggregate(m=Max("minute"))["m"]
    # After a pause (or on a new installation) the missing minutes are filled in, up to a day.
    gap = int((floor_minute(now) - latest).total_seconds() // 60) + 1 if latest else 60
    return history_rollup(now, minutes=min(max(gap, RECOMPUTE_MINUTES), 24 * 60))


def backfill(now: datetime | None = None, *, hours: int = 24) -> int:
    """Roll up the past `hours` (a new installation, or after the dispatcher was down)."""
    return history_rollup(now, minutes=hours * 60)
