"""Retry, poll, breaker and timeout policies, and Retry-After parsing (no database)."""

import random
from datetime import UTC, datetime
from email.utils import format_datetime

from tasks.vendors.policies import (
    BreakerPolicy,
    PollPolicy,
    RetryPolicy,
    TimeoutPolicy,
    parse_retry_after,
)


def test_full_jitter_stays_under_the_exponential_ceiling_and_the_cap():
    policy = RetryPolicy(base_s=1, cap_s=10)
    rng = random.Random(7)
    for n in range(8):
        ceiling = min(10, 2**n)
        delays = [policy.delay_s(n, rng=rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8  # really spread over the whole range


def test_full_jitter_spreads_a_herd_instead_of_bunching_it():
    policy = RetryPolicy(base_s=1, cap_s=30)
    rng = random.Random(3)
    delays = sorted(policy.delay_s(4, rng=rng) for _ in range(100))
    assert delays[-1] - delays[0] > 10


def test_retry_after_is_a_minimum_with_jitter_on_top_and_capped():
    policy = RetryPolicy(base_s=1, cap_s=60, retry_after_cap_s=30)
    rng = random.Random(1)
    for _ in range(100):
        delay = policy.delay_s(0, retry_after_s=7, rng=rng)
        assert 7 <= delay <= 7 + max(1, 0.25 * 7)
    assert policy.delay_s(0, retry_after_s=1000, rng=rng) <= 30 + 7.5


def test_retry_after_delta_seconds():
    assert parse_retry_after("120") == 120.0
    assert parse_retry_after(" 0 ") == 0.0


def test_retry_after_http_date_is_read_against_the_response_date():
    date_header = "Sun, 29 Nov 2026 18:00:00 GMT"
    assert parse_retry_after("Sun, 29 Nov 2026 18:00:07 GMT", date_header=date_header) == 7.0
    now = datetime(2026, 11, 29, 18, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2026, 11, 29, 18, 0, 30, tzinfo=UTC), usegmt=True)
    assert parse_retry_after(later, now=now) == 30.0


def test_malformed_or_past_retry_after_is_ignored_or_zero():
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-5") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("Sun, 29 Nov 2026 17:59:00 GMT", date_header="Sun, 29 Nov 2026 18:00:00 GMT") == 0.0


def test_polls_start_at_three_seconds_and_double_to_a_minute():
    policy = PollPolicy()
    intervals, previous = [], 0.0
    for _ in range(8):
        previous = policy.next_interval_s(previous)
        intervals.append(previous)
    assert intervals == [3, 6, 12, 24, 48, 60, 60, 60]


def test_poll_jitter_only_delays():
    policy = PollPolicy()
    rng = random.Random(5)
    assert all(10 <= policy.jittered(10, rng) <= 12.5 for _ in range(100))


def test_upload_timeout_grows_with_size_within_floor_and_cap():
    policy = TimeoutPolicy(upload_buffer_s=5, bandwidth_bytes_s=1_000_000, upload_floor_s=10, upload_cap_s=600)
    assert policy.upload_budget_s(1000) == 10
    assert policy.upload_budget_s(200_000_000) == 205
    assert policy.upload_budget_s(10**12) == 600


def test_a_fixed_upload_timeout_ignores_size():
    policy = TimeoutPolicy(upload_policy="fixed", upload_fixed_s=30)
    assert policy.upload_budget_s(10**9) == 30


def test_breaker_needs_the_minimum_number_of_calls():
    policy = BreakerPolicy(minimum_calls=10, failure_rate=0.5)
    assert not policy.should_open(calls=9, failures=9, slow=0)
    assert policy.should_open(calls=10, failures=5, slow=0)
    assert not policy.should_open(calls=10, failures=4, slow=0)


def test_breaker_opens_on_slow_calls_too():
    policy = BreakerPolicy(minimum_calls=4, slow_call_rate=0.75)
    assert policy.should_open(calls=4, failures=0, slow=3)


def test_half_open_trials_close_only_when_all_succeed():
    policy = BreakerPolicy(half_open_calls=2)
    assert policy.half_open_verdict(successes=1, failures=0) is None
    assert policy.half_open_verdict(successes=2, failures=0) == "closed"
    assert policy.half_open_verdict(successes=1, failures=1) == "open"
