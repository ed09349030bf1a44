"""Tenant quotas with time-boxed overrides, checked at intake and at dispatch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Count, Min, Sum
from django.utils import timezone

from tasks import counters, timescale
from tasks.errors import OverQuota
from tasks.models import QuotaOverride, Task, Tenant, TenantQuota
from tasks.rows import select
from tasks.states import State

WAITING_STATES = (State.ACCEPTED, State.QUEUED, State.RETRY_WAIT)
MINUTE_S = 60.0
DAY_S = 86400.0


@dataclass(frozen=True)
class EffectiveQuota:
    max_queued: int | None = None
    max_running: int | None = None
    submissions_per_minute: int | None = None
    bytes_per_day: int | None = None
    units_per_day: int | None = None
    lane_weights: dict[str, float] = field(default_factory=dict)

    def weight(self, lane: str) -> float:
        try:
            return max(float(self.lane_weights.get(lane, 1)), 0.01)
        except (TypeError, ValueError):
            return 1.0


def quota_effective(tenant: Tenant, *, now: datetime | None = None) -> EffectiveQuota:
    return quotas_effective([tenant.pk], now=now)[tenant.pk]


# Quotas are read by every submission and every admission pass. A process reuses the rows it read
# this recently (real seconds): a change saved in this process applies at once (saving or deleting
# a quota or an override forgets them, see tasks/apps.py), one saved elsewhere within this time.
# Overrides are kept with their times, so one starts and ends exactly when it says.
QUOTA_FRESH_S = 2.0


@dataclass(frozen=True)
class _Rows:
    read_at: float
    base: dict[str, Any]
    overrides: tuple[tuple[datetime, datetime, str, int | None], ...]  # (starts, ends, field, value)


_rows: dict[Any, _Rows] = {}


def quotas_forget(*_args: Any, **_kwargs: Any) -> None:
    """Forget every quota this process has read (a quota or an override changed)."""
    _rows.clear()


def quotas_effective(tenant_ids: list, *, now: datetime | None = None) -> dict:
    """Each tenant's quota with the overrides active at `now`, for any number of tenants: two
    statements for those not read in the last QUOTA_FRESH_S, none for the others."""
    now = now or timezone.now()
    stale = [t for t in tenant_ids if t not in _rows or time.monotonic() - _rows[t].read_at > QUOTA_FRESH_S]
    if stale:
        _read(stale, now)
    effective = {}
    for tenant_id in tenant_ids:
        rows = _rows[tenant_id]
        values = dict(rows.base)
        for starts, ends, name, value in rows.overrides:  # in creation order: the newest wins
            if starts <= now < ends:
                values[name] = value
        weights = values.pop("lane_weights") or {}
        effective[tenant_id] = EffectiveQuota(lane_weights=weights, **values)
    return effective


def _read(tenant_ids: list, now: datetime) -> None:
    fields = (*QuotaOverride.QUOTA_FIELDS, "lane_weights")
    among = f"t.tenant_id IN ({', '.join(['%s'] * len(tenant_ids))})"
    keys = [("tenant", tenant_id) for tenant_id in tenant_ids]
    bases = {row.tenant_id: {name: getattr(row, name) for name in fields}
             for row in select(TenantQuota, among, keys, only=("tenant", *fields))}
    for tenant_id in set(tenant_ids) - set(bases):
        quota, _ = TenantQuota.objects.get_or_create(tenant_id=tenant_id)
        bases[tenant_id] = {name: getattr(quota, name) for name in fields}
    overrides: dict[Any, list] = {t: [] for t in tenant_ids}
    pending = select(QuotaOverride, f"{among} AND t.ends_at > %s ORDER BY t.created_at, t.id", [*keys, ("ends_at", now)],
                     only=("tenant", "starts_at", "ends_at", "field", "value"))
    for row in pending:
        overrides[row.tenant_id].append((row.starts_at, row.ends_at, row.field, row.value))
    read_at = time.monotonic()
    if len(_rows) > 10_000:
        _rows.clear()
    for tenant_id in tenant_ids:
        base = {name: bases[tenant_id][name] for name in fields}
        _rows[tenant_id] = _Rows(read_at=read_at, base=base, overrides=tuple(overrides[tenant_id]))


@dataclass
class QuotaUsage:
    """What a tenant has used of its counted quotas, read once while its quota lock is held; the
    submissions of one request are added to it as they are accepted."""

    waiting: int = 0
    recent: int = 0
    oldest_recent: datetime | None = None
    bytes_today: int = 0
    units_today: int = 0

    @classmethod
    def read(cls, tenant: Tenant, quota: EffectiveQuota, *, now: datetime) -> QuotaUsage:
        """Only what the quota limits is counted (nothing, for a tenant without counted quotas)."""
        usage = cls()
        if quota.max_queued is not None:
            counted = counters.tenant_counts(tenant.pk)  # WAITING_STATES, from the counter rows
            usage.waiting = counted["accepted"] + counted["queued"] + counted["dispatched"] + counted["retry_wait"]
        if quota.submissions_per_minute is not None:
            recent = Task.objects.filter(tenant=tenant, created_at__gte=now - timescale.delta(MINUTE_S))
            counted = recent.aggregate(n=Count("id"), oldest=Min("created_at"))
            usage.recent, usage.oldest_recent = counted["n"], counted["oldest"]
        today = Task.objects.filter(tenant=tenant, created_at__gte=now - timescale.delta(DAY_S))
        if quota.bytes_per_day is not None:
            usage.bytes_today = today.aggregate(s=Sum("file__size"))["s"] or 0
        if quota.units_per_day is not None:
            usage.units_today = today.aggregate(s=Sum("estimated_units"))["s"] or 0
        return usage

    def refusal(self, quota: EffectiveQuota, *, size: int, units: int | None, now: datetime) -> OverQuota | None:
        """The first quota one more submission would break, as the error to answer; None if none."""
        if quota.max_queued is not None and self.waiting >= quota.max_queued:
            return OverQuota(
                f"Quota max_queued reached: {self.waiting} of {quota.max_queued} tasks are waiting. Retry when some have started.",
                retry_after=timescale.seconds(30), quota="max_queued",
            )
        if quota.submissions_per_minute is not None and self.recent >= quota.submissions_per_minute:
            window = now - timescale.delta(MINUTE_S)
            wait = max(((self.oldest_recent or now) - window).total_seconds(), 1.0)
            return OverQuota(
                f"Quota submissions_per_minute reached: {self.recent} of {quota.submissions_per_minute}.",
                retry_after=wait, quota="submissions_per_minute",
            )
        if quota.bytes_per_day is not None and self.bytes_today + size > quota.bytes_per_day:
            return OverQuota(
                f"Quota bytes_per_day reached: {self.bytes_today} of {quota.bytes_per_day} bytes used in the last day.",
                retry_after=timescale.seconds(3600), quota="bytes_per_day",
            )
        if quota.units_per_day is not None and units is not None and self.units_today + units > quota.units_per_day:
            return OverQuota(
                f"Quota units_per_day reached: {self.units_today} of {quota.units_per_day} billable units used in the last day.",
                retry_after=timescale.seconds(3600), quota="units_per_day",
            )
        return None

    def add(self, *, size: int, units: int | None, now: datetime) -> None:
        """One more submission accepted."""
        self.waiting += 1
        self.recent += 1
        self.oldest_recent = self.oldest_recent or now
        self.bytes_today += size
        self.units_today += units or 0


def counts_submissions(quota: EffectiveQuota) -> bool:
    """The tenant has a quota that counts what it submitted (so submissions must be serialised)."""
    return any(v is not None for v in (quota.max_queued, quota.submissions_per_minute, quota.bytes_per_day,
                                       quota.units_per_day))


def tenant_running(tenant_id) -> int:
    """Tasks holding an execution slot, in every lane (from the counter rows: one statement, so a
    task that moves from dispatched to RUNNING meanwhile is counted once)."""
    counted = counters.tenant_counts(tenant_id)
    return counted["dispatched"] + counted["in_flight"]
