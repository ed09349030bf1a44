"""A circuit breaker per channel whose state lives in the database, shared by every process.

CLOSED → OPEN when the sliding window of recent calls trips the policy; OPEN → HALF_OPEN after
the open wait; HALF_OPEN admits a limited number of trial calls whose outcome closes or re-opens
it. FORCED_OPEN and DISABLED are set by operators. Every state change is a compare-and-set on
`breaker_version`, so two processes deciding at once cannot both win.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import F, Max, Value
from django.db.models.functions import Least
from django.utils import timezone

from tasks import timescale
from tasks.models import BreakerTransition, ChannelHealth, VendorCall, VendorChannel
from tasks.observability import log_event
from tasks.rows import select
from tasks.vendors.errors import BreakerOpen
from tasks.vendors.policies import BreakerPolicy

B = ChannelHealth.Breaker


@dataclass(frozen=True)
class Permit:
    channel: str
    trial: bool
    version: int


# A call on a closed breaker does not read the shared row each time: a process reuses what it
# read this recently (real seconds). A breaker another process opened is seen that much later,
# at most a call or two per process; every other state is read afresh for each call.
HEALTH_FRESH_S = 0.25
_seen: dict[tuple[int, str], tuple[float, ChannelHealth]] = {}


def health_for(channel: VendorChannel) -> ChannelHealth:
    found = select(ChannelHealth, "t.channel_id = %s", [("channel", channel.pk)])  # read on every step's calls
    health = found[0] if found else ChannelHealth.objects.get_or_create(
        channel=channel, defaults={"retry_tokens": channel.retry_budget_capacity})[0]
    return seen(channel, health)


def seen(channel: VendorChannel, health: ChannelHealth) -> ChannelHealth:
    """Note a channel's health row just read (here, or with the channel elsewhere: admission
    reads every channel's), so that this process's next calls within HEALTH_FRESH_S reuse it."""
    _seen[(os.getpid(), channel.pk)] = (time.monotonic(), health)
    return health


def _recent_health(channel: VendorChannel) -> ChannelHealth | None:
    seen = _seen.get((os.getpid(), channel.pk))
    if seen is None or time.monotonic() - seen[0] > HEALTH_FRESH_S:
        return None
    return seen[1]


def _forget(channel_name: str) -> None:
    _seen.pop((os.getpid(), channel_name), None)


def _reopen_at(health: ChannelHealth, policy: BreakerPolicy) -> datetime | None:
    if health.opened_at is None:
        return None
    return health.opened_at + timescale.delta(policy.open_wait_s)


def retry_in_s(channel: VendorChannel, health: ChannelHealth | None = None) -> float | None:
    """Real seconds until an OPEN breaker lets a trial through; None if it is not open."""
    health = health or health_for(channel)
    if health.breaker_state not in (B.OPEN, B.FORCED_OPEN):
        return None
    reopen = _reopen_at(health, BreakerPolicy.for_channel(channel))
    if health.breaker_state == B.FORCED_OPEN or reopen is None:
        return timescale.seconds(BreakerPolicy.for_channel(channel).open_wait_s)
    return max((reopen - timezone.now()).total_seconds(), 0.0)


def is_available(channel: VendorChannel, health: ChannelHealth | None = None) -> bool:
    """Would a call be permitted now (without taking a permit)?"""
    health = health or health_for(channel)
    state = health.breaker_state
    if state in (B.CLOSED, B.DISABLED):
        return True
    if state == B.FORCED_OPEN:
        return False
    policy = BreakerPolicy.for_channel(channel)
    if state == B.OPEN:
        reopen = _reopen_at(health, policy)
        return reopen is not None and timezone.now() >= reopen
    return health.half_open_permits_used < policy.half_open_calls


def trials_lost(health: ChannelHealth, policy: BreakerPolicy, *, now: datetime | None = None) -> bool:
    """A HALF_OPEN breaker whose last trial permit was taken long ago without a verdict: the calls
    that took them died with their worker (killed, or cut off from the database before it could
    write the outcome) and will never report. Long ago: the open wait, or the slow-call bound when
    longer (a trial still running then counts as failed anyway)."""
    if health.breaker_state != B.HALF_OPEN or health.half_open_permits_used < policy.half_open_calls:
        return False
    since = health.updated_at  # set when the last permit was taken (outcomes are counted without it)
    return since is not None and (now or timezone.now()) - since > timescale.delta(max(policy.open_wait_s, policy.slow_call_s))


def reopen_if_trials_lost(channel: VendorChannel, health: ChannelHealth | None = None) -> bool:
    """Open a breaker whose trials were lost again, so that after its open wait new trials decide."""
    health = health or health_for(channel)
    if not trials_lost(health, BreakerPolicy.for_channel(channel)):
        return False
    return _cas(health, B.HALF_OPEN, B.OPEN, actor="breaker: trial calls never reported", opened_at=timezone.now())


def acquire(channel: VendorChannel) -> Permit:
    """Permission for one call, or BreakerOpen."""
    recent = _recent_health(channel)
    if recent is not None and recent.breaker_state in (B.CLOSED, B.DISABLED):
        return Permit(channel.name, trial=False, version=recent.breaker_version)
    policy = BreakerPolicy.for_channel(channel)
    for _ in range(5):
        health = health_for(channel)
        state = health.breaker_state
        if state in (B.CLOSED, B.DISABLED):
            return Permit(channel.name, trial=False, version=health.breaker_version)
        if state == B.FORCED_OPEN:
            raise BreakerOpen(retry_in_s(channel, health))
        if state == B.OPEN:
            reopen = _reopen_at(health, policy)
            if reopen is not None and timezone.now() < reopen:
                raise BreakerOpen((reopen - timezone.now()).total_seconds())
            _cas(health, B.OPEN, B.HALF_OPEN, half_open_permits_used=0, half_open_successes=0, half_open_failures=0)
            continue
        # HALF_OPEN: take one of the limited trial permits.
        taken = ChannelHealth.objects.filter(
            pk=channel.pk,
            breaker_state=B.HALF_OPEN,
            breaker_version=health.breaker_version,
            half_open_permits_used__lt=policy.half_open_calls,
        ).update(half_open_permits_used=F("half_open_permits_used") + 1, updated_at=timezone.now())
        if taken:
            return Permit(channel.name, trial=True, version=health.breaker_version)
        if reopen_if_trials_lost(channel, health):
            continue
        fresh = health_for(channel)
        if fresh.breaker_state == B.HALF_OPEN and fresh.breaker_version == health.breaker_version:
            raise BreakerOpen(timescale.seconds(min(policy.open_wait_s, 5)))
    raise BreakerOpen(timescale.seconds(1))


def record(channel: VendorChannel, permit: Permit | None, *, failure: bool) -> None:
    """Feed one call's outcome to the breaker (the VendorCall row is already written)."""
    if not failure and (permit is None or not permit.trial):
        return  # only failures and trial calls move a breaker
    policy = BreakerPolicy.for_channel(channel)
    health = health_for(channel)
    if permit is not None and permit.trial:
        if health.breaker_state != B.HALF_OPEN or health.breaker_version != permit.version:
            return
        counter = "half_open_failures" if failure else "half_open_successes"
        ChannelHealth.objects.filter(pk=channel.pk, breaker_version=permit.version).update(**{counter: F(counter) + 1})
        health.refresh_from_db()
        verdict = policy.half_open_verdict(
            successes=health.half_open_successes, failures=health.half_open_failures
        )
        if verdict == "open":
            _cas(health, B.HALF_OPEN, B.OPEN, opened_at=timezone.now())
        elif verdict == "closed":
            newest = VendorCall.objects.filter(channel=channel).aggregate(m=Max("id"))["m"] or 0
            _cas(health, B.HALF_OPEN, B.CLOSED, opened_at=None, window_started_call_id=newest)
        return
    if health.breaker_state != B.CLOSED:
        return
    window = list(
        VendorCall.objects.filter(channel=channel, counts_for_breaker=True, id__gt=health.window_started_call_id)
        .order_by("-id")
        .values_list("breaker_failure", "slow")[: policy.window]
    )
    failures = sum(1 for f, _ in window if f)
    slow = sum(1 for _, s in window if s)
    if policy.should_open(calls=len(window), failures=failures, slow=slow):
        _cas(health, B.CLOSED, B.OPEN, opened_at=timezone.now())


def force(channel: VendorChannel, state: str, *, actor: str) -> bool:
    """Operator override: FORCED_OPEN, DISABLED, or back to CLOSED."""
    if state not in (B.FORCED_OPEN, B.DISABLED, B.CLOSED):
        raise ValueError(f"cannot force a breaker to {state}")
    health = health_for(channel)
    newest = VendorCall.objects.filter(channel=channel).aggregate(m=Max("id"))["m"] or 0
    moved = _cas(
        health,
        health.breaker_state,
        state,
        opened_at=timezone.now() if state == B.FORCED_OPEN else None,
        window_started_call_id=newest,
        actor=actor,
    )
    return moved


def _cas(health: ChannelHealth, source: str, target: str, *, actor: str = "breaker", **fields) -> bool:
    _forget(health.pk)
    moved = ChannelHealth.objects.filter(
        pk=health.pk, breaker_state=source, breaker_version=health.breaker_version
    ).update(breaker_state=target, breaker_version=F("breaker_version") + 1, updated_at=timezone.now(), **fields)
    if moved:
        BreakerTransition.objects.create(channel_id=health.pk, from_state=source, to_state=target, actor=actor[:150])
        log_event("breaker_transition", channel=health.pk, from_state=source, to_state=target, reason=actor)
    return bool(moved)


def take_retry_token(channel: VendorChannel, *, timeout: bool) -> bool:
    """Spend from the channel's retry budget (AWS SDK standard mode); False when dry.

    The bucket refills slowly with time as well as on successes, so an outage with no successes
    does not stop retries forever, it only slows them to the refill rate.
    """
    cost = channel.retry_timeout_cost if timeout else channel.retry_cost
    health_for(channel)
    _forget(channel.pk)
    with transaction.atomic():
        health = ChannelHealth.objects.select_for_update().get(pk=channel.pk)
        now = timezone.now()
        tokens = health.retry_tokens
        if health.retry_tokens_at is not None:
            elapsed = timescale.nominal(max((now - health.retry_tokens_at).total_seconds(), 0.0))
            tokens = min(channel.retry_budget_capacity, tokens + elapsed * channel.retry_refill_per_s)
        granted = tokens >= cost
        ChannelHealth.objects.filter(pk=channel.pk).update(
            retry_tokens=tokens - cost if granted else tokens, retry_tokens_at=now
        )
    return granted


def refund_retry_token(channel: VendorChannel) -> None:
    recent = _recent_health(channel)
    if recent is not None and recent.retry_tokens >= channel.retry_budget_capacity:
        return  # full a moment ago: a success has nothing to give back
    _forget(channel.pk)
    ChannelHealth.objects.filter(pk=channel.pk, retry_tokens__lt=channel.retry_budget_capacity).update(
        retry_tokens=Least(F("retry_tokens") + channel.retry_success_refund, Value(channel.retry_budget_capacity))
    )


def reset_retry_budget(channel: VendorChannel) -> None:
    health_for(channel)
    _forget(channel.pk)
    ChannelHealth.objects.filter(pk=channel.pk).update(retry_tokens=channel.retry_budget_capacity, retry_tokens_at=timezone.now())
