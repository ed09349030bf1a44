"""Tenant quotas with time-boxed overrides, checked at intake and at dispatch."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Min, Q, Sum
from django.utils import timezone

from tasks import timescale
from tasks.errors import OverQuota
from tasks.models import QuotaOverride, Task, Tenant, TenantQuota
from tasks.states import IN_FLIGHT_STATES, State

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
    now = now or timezone.now()
    base, _ = TenantQuota.objects.get_or_create(tenant=tenant)
    values = {name: getattr(base, name) for name in QuotaOverride.QUOTA_FIELDS}
    for override in QuotaOverride.objects.filter(tenant=tenant, starts_at__lte=now, ends_at__gt=now).order_by("created_at"):
        values[override.field] = override.value
    return EffectiveQuota(lane_weights=base.lane_weights or {}, **values)


def quota_check_submission(tenant: Tenant, *, size: int, units: int | None) -> None:
    """Raise OverQuota naming the first quota this submission would break."""
    now = timezone.now()
    quota = quota_effective(tenant, now=now)
    if quota.max_queued is not None:
        waiting = Task.objects.filter(tenant=tenant, state__in=WAITING_STATES).count()
        if waiting >= quota.max_queued:
            raise OverQuota(
                f"Quota max_queued reached: {waiting} of {quota.max_queued} tasks are waiting. Retry when some have started.",
                retry_after=timescale.seconds(30), quota="max_queued",
            )
    if quota.submissions_per_minute is not None:
        window = now - timescale.delta(MINUTE_S)
        recent = Task.objects.filter(tenant=tenant, created_at__gte=window)
        count = recent.count()
        if count >= quota.submissions_per_minute:
            oldest = recent.aggregate(m=Min("created_at"))["m"] or now
            wait = max((oldest - window).total_seconds(), 1.0)
            raise OverQuota(
                f"Quota submissions_per_minute reached: {count} of {quota.submissions_per_minute}.",
                retry_after=wait, quota="submissions_per_minute",
            )
    day_start = now - timescale.delta(DAY_S)
    if quota.bytes_per_day is not None:
        used = Task.objects.filter(tenant=tenant, created_at__gte=day_start).aggregate(s=Sum("file__size"))["s"] or 0
        if used + size > quota.bytes_per_day:
            raise OverQuota(
                f"Quota bytes_per_day reached: {used} of {quota.bytes_per_day} bytes used in the last day.",
                retry_after=timescale.seconds(3600), quota="bytes_per_day",
            )
    if quota.units_per_day is not None and units is not None:
        used = Task.objects.filter(tenant=tenant, created_at__gte=day_start).aggregate(s=Sum("estimated_units"))["s"] or 0
        if used + units > quota.units_per_day:
            raise OverQuota(
                f"Quota units_per_day reached: {used} of {quota.units_per_day} billable units used in the last day.",
                retry_after=timescale.seconds(3600), quota="units_per_day",
            )


def tenant_running(tenant_id) -> int:
    """Tasks holding an execution slot. One statement: two counts could miss a task that moves
    from dispatched to RUNNING between them."""
    return Task.objects.filter(tenant_id=tenant_id).filter(
        Q(state__in=IN_FLIGHT_STATES) | Q(state=State.QUEUED, dispatched_at__isnull=False)
    ).count()
