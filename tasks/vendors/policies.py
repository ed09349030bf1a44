"""Policies as frozen values with one decision method each (no database, easy to unit-test).

All durations are nominal seconds; callers multiply them by the time scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

from tasks.vendors.classification import Failure

if TYPE_CHECKING:
    from tasks.models import VendorChannel


@dataclass(frozen=True)
class TimeoutPolicy:
    """Time layers: connect, small reads, results, and a size-derived upload budget."""

    connect_s: float = 5
    status_s: float = 10
    result_s: float = 30
    upload_policy: str = "size_derived"
    upload_buffer_s: float = 5
    bandwidth_bytes_s: float = 1024 * 1024
    upload_floor_s: float = 10
    upload_cap_s: float = 3600
    upload_fixed_s: float = 30

    def upload_budget_s(self, size: int) -> float:
        """Wall-clock budget for sending `size` bytes and getting the acceptance back."""
        if self.upload_policy == "fixed":
            return self.upload_fixed_s
        derived = self.upload_buffer_s + size / max(self.bandwidth_bytes_s, 1.0)
        return min(max(derived, self.upload_floor_s), self.upload_cap_s)

    def acceptance_wait_s(self) -> float:
        """How long to wait for the answer once the body is sent."""
        if self.upload_policy == "fixed":
            return self.upload_fixed_s
        return max(self.upload_buffer_s, self.status_s)

    @classmethod
    def for_channel(cls, channel: VendorChannel) -> TimeoutPolicy:
        return cls(
            connect_s=channel.connect_timeout_s,
            status_s=channel.status_timeout_s,
            result_s=channel.result_timeout_s,
            upload_policy=channel.upload_timeout_policy,
            upload_buffer_s=channel.upload_buffer_s,
            bandwidth_bytes_s=channel.upload_bandwidth_bytes_s,
            upload_floor_s=channel.upload_timeout_floor_s,
            upload_cap_s=channel.upload_timeout_cap_s,
            upload_fixed_s=channel.upload_fixed_timeout_s,
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Full-jitter exponential backoff; a Retry-After is a minimum (capped) with jitter on top."""

    base_s: float = 1
    cap_s: float = 60
    retry_after_cap_s: float = 300
    max_attempts: int = 5

    def delay_s(self, retry_number: int, retry_after_s: float | None = None, rng: random.Random | None = None) -> float:
        rng = rng or random
        ceiling = min(self.cap_s, self.base_s * (2 ** min(retry_number, 30)))
        if retry_after_s is not None and retry_after_s >= 0:
            floor = min(retry_after_s, self.retry_after_cap_s)
            return floor + rng.uniform(0, max(self.base_s, 0.25 * floor))
        return rng.uniform(0, ceiling)

    def exhausted(self, attempts_on_channel: int) -> bool:
        return attempts_on_channel >= self.max_attempts

    @classmethod
    def for_channel(cls, channel: VendorChannel) -> RetryPolicy:
        return cls(
            base_s=channel.retry_base_s,
            cap_s=channel.retry_cap_s,
            retry_after_cap_s=channel.retry_after_cap_s,
            max_attempts=channel.max_attempts,
        )


@dataclass(frozen=True)
class RetrySituation:
    """What the retry decision needs to know about a task, as plain values (nominal seconds)."""

    channel: str
    kind: str
    channel_attempts: int
    time_left_s: float
    has_fallback: bool = False
    other_channels_exist: bool = False
    abandoned_any: bool = False
    in_outage: bool = False
    breaker_retry_in_s: float | None = None


@dataclass(frozen=True)
class RetryDecision:
    """What happens after a failure. `action`: retry (same channel), fall_back (another channel),
    wait_for_channels (every channel is down: a durable outage wait) or fail."""

    action: str
    delay_s: float = 0.0
    waiting_reason: str = ""
    summary: str = ""
    counts_attempt: bool = False
    needs_retry_token: bool = False
    fail_code: str = ""
    fail_message: str = ""


@dataclass(frozen=True)
class RetryDecider:
    """The retry/fallback decision as a pure value: writes nothing, reads no database.

    A failure that was provably not processed is retried (Retry-After first, full-jitter backoff),
    on another channel once this one's attempts are spent; when every channel is spent and the
    last one could not take the work at all, the task waits for any to recover, one try per
    capped backoff; other failures then fail (`retries_exhausted`). Flow control (429, a key in
    flight, an open breaker) never counts as an attempt. No retry is planned past the business
    deadline."""

    policy: RetryPolicy

    def decide(self, failure: Failure, situation: RetrySituation, rng: random.Random | None = None) -> RetryDecision:
        rng = rng or random
        policy = self.policy
        flow = failure.flow_control
        spent = not flow and policy.exhausted(situation.channel_attempts + 1)
        if failure.breaker_open and situation.has_fallback:
            decision = RetryDecision("fall_back", policy.base_s * 0.1, summary=f"breaker open: fall back from {situation.channel}")
        elif failure.breaker_open:
            alone = not situation.other_channels_exist or situation.abandoned_any
            decision = RetryDecision("retry", max(situation.breaker_retry_in_s or 0.0, policy.base_s) * 1.1,
                                     waiting_reason="all_channels_down" if alone else "breaker_open",
                                     summary="breaker open: wait for it")
        elif spent and not situation.has_fallback and not failure.unavailable:
            return RetryDecision("fail", fail_code="retries_exhausted",
                                 fail_message=f"{failure.message}; retries on every channel are spent")
        elif (spent and not situation.has_fallback) or (situation.in_outage and failure.unavailable and not flow):
            decision = RetryDecision("wait_for_channels", policy.cap_s * rng.uniform(0.5, 1.0), waiting_reason="all_channels_down",
                                     summary=f"every channel for {situation.kind} failed ({failure.code}): wait for one to recover")
        elif spent:
            decision = RetryDecision("fall_back", policy.delay_s(0, rng=rng), summary=f"retries on {situation.channel} spent: fall back")
        else:
            delay = policy.delay_s(situation.channel_attempts, failure.retry_after_s, rng=rng)
            decision = RetryDecision("retry", delay, waiting_reason="rate_limited" if failure.code == "http_429" else "retry_backoff",
                                     summary=f"retry on {situation.channel} in {delay:.1f}s", counts_attempt=not flow,
                                     needs_retry_token=not flow)
        return self._bounded(decision, failure, situation)

    def when_budget_dry(self, failure: Failure, situation: RetrySituation, rng: random.Random | None = None) -> RetryDecision:
        """The channel's retry budget is dry: slow down rather than multiply an outage's traffic."""
        delay = self.policy.cap_s * (rng or random).uniform(0.5, 1.0)
        return self._bounded(RetryDecision("retry", delay, waiting_reason="retry_budget_dry",
                                           summary=f"retry budget of {situation.channel} is dry: wait {delay:.1f}s"),
                             failure, situation)

    @staticmethod
    def _bounded(decision: RetryDecision, failure: Failure, situation: RetrySituation) -> RetryDecision:
        if decision.action != "fail" and decision.delay_s >= situation.time_left_s:
            return RetryDecision("fail", fail_code="deadline_exceeded",
                                 fail_message=f"the business deadline passes before the next try ({failure.message}; "
                                              f"waiting: {decision.waiting_reason or 'retry_backoff'})")
        return decision


@dataclass(frozen=True)
class PollPolicy:
    """First poll after `initial_s`, doubling to `max_interval_s`, jittered upwards, within a budget."""

    initial_s: float = 3
    max_interval_s: float = 60
    budget_s: float = 900

    def next_interval_s(self, previous_s: float) -> float:
        if previous_s <= 0:
            return self.initial_s
        return min(self.max_interval_s, previous_s * 2)

    def jittered(self, interval_s: float, rng: random.Random | None = None) -> float:
        # Only ever later than the schedule, so the request rate stays under its bound.
        return interval_s * (rng or random).uniform(1.0, 1.25)

    @classmethod
    def for_channel(cls, channel: VendorChannel) -> PollPolicy:
        return cls(
            initial_s=channel.poll_initial_s,
            max_interval_s=channel.poll_max_interval_s,
            budget_s=channel.poll_budget_s,
        )


@dataclass(frozen=True)
class BreakerPolicy:
    """resilience4j's count-based window: trip on failure or slow-call rate over enough calls."""

    window: int = 20
    minimum_calls: int = 10
    failure_rate: float = 0.5
    slow_call_s: float = 30
    slow_call_rate: float = 1.0
    open_wait_s: float = 30
    half_open_calls: int = 2

    def should_open(self, *, calls: int, failures: int, slow: int) -> bool:
        if calls < max(self.minimum_calls, 1):
            return False
        return failures / calls >= self.failure_rate or slow / calls >= self.slow_call_rate

    def half_open_verdict(self, *, successes: int, failures: int) -> str | None:
        """After trial calls: "open" on any failure, "closed" once all trials succeeded."""
        if failures:
            return "open"
        if successes >= self.half_open_calls:
            return "closed"
        return None

    @classmethod
    def for_channel(cls, channel: VendorChannel) -> BreakerPolicy:
        return cls(
            window=channel.breaker_window,
            minimum_calls=channel.breaker_minimum_calls,
            failure_rate=channel.breaker_failure_rate,
            slow_call_s=channel.breaker_slow_call_s,
            slow_call_rate=channel.breaker_slow_call_rate,
            open_wait_s=channel.breaker_open_wait_s,
            half_open_calls=channel.breaker_half_open_calls,
        )


def parse_retry_after(value: str | None, *, date_header: str | None = None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After value: delta-seconds or an HTTP-date (RFC 9110 §10.2.3).

    An HTTP-date is compared with the response's own Date header when there is one, so clock
    skew between us and the vendor does not matter. Malformed or negative values are ignored.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if value.isdigit():
        return float(int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    reference = None
    if date_header:
        try:
            reference = parsedate_to_datetime(date_header)
        except (TypeError, ValueError, IndexError):
            reference = None
    reference = reference or now or datetime.now(UTC)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if reference.tzinfo is None:
        reference = reference.replace(tzinfo=UTC)
    seconds = (when - reference).total_seconds()
    return max(seconds, 0.0)
