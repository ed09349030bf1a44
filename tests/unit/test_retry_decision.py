"""The retry/fallback decision as a pure value: every branch, without a database."""

import random

import pytest

from tasks.vendors.classification import Failure, Outcome, classify_exception, classify_status
from tasks.vendors.errors import VendorError
from tasks.vendors.policies import RetryDecider, RetryPolicy, RetrySituation

POLICY = RetryPolicy(base_s=1, cap_s=60, retry_after_cap_s=300, max_attempts=5)
DECIDER = RetryDecider(POLICY)


def failure_of(status=None, exception=None, **extra) -> Failure:
    row = classify_status(status) if status else classify_exception(exception)
    error = VendorError(row, operation="create_job", status=status, error_class=exception or "", **extra)
    return error.failure


def situation(**values) -> RetrySituation:
    return RetrySituation(**{"channel": "primary", "kind": "transcription", "channel_attempts": 0,
                             "time_left_s": 86400.0, **values})


def test_a_not_processed_failure_is_retried_on_the_same_channel_and_counts_an_attempt():
    decision = DECIDER.decide(failure_of(503), situation(), rng=random.Random(1))
    assert decision.action == "retry" and decision.counts_attempt and decision.needs_retry_token
    assert 0 <= decision.delay_s <= POLICY.base_s * 2 ** 0 + 1e-9


def test_retry_after_is_a_minimum_with_jitter_on_top():
    decision = DECIDER.decide(failure_of(429, retry_after_s=7), situation(), rng=random.Random(1))
    assert decision.action == "retry" and decision.delay_s >= 7 and decision.waiting_reason == "rate_limited"
    assert not decision.counts_attempt and not decision.needs_retry_token, "flow control is waited out, not counted"


def test_spent_attempts_fall_back_when_another_channel_serves_the_kind():
    decision = DECIDER.decide(failure_of(503), situation(channel_attempts=4, has_fallback=True))
    assert decision.action == "fall_back"


@pytest.mark.parametrize("make", [lambda: failure_of(503), lambda: failure_of(exception="ConnectError")],
                         ids=["503", "connect"])
def test_every_channel_spent_on_unavailable_vendors_is_a_durable_outage_wait(make):
    decision = DECIDER.decide(make(), situation(channel_attempts=4), rng=random.Random(3))
    assert decision.action == "wait_for_channels" and decision.waiting_reason == "all_channels_down"
    assert POLICY.cap_s * 0.5 <= decision.delay_s <= POLICY.cap_s


def test_in_an_outage_each_unavailable_answer_waits_the_capped_backoff_not_a_fresh_round_of_fast_retries():
    decision = DECIDER.decide(failure_of(503), situation(in_outage=True), rng=random.Random(2))
    assert decision.action == "wait_for_channels" and decision.delay_s >= POLICY.cap_s * 0.5


def test_spent_attempts_on_a_failure_that_is_not_an_outage_fail_as_retries_exhausted():
    upload_timeout = Failure(Outcome.NOT_PROCESSED, code="uploaddeadlineexceeded", message="the upload was too slow")
    decision = DECIDER.decide(upload_timeout, situation(channel_attempts=4))
    assert decision.action == "fail" and decision.fail_code == "retries_exhausted"


def test_a_failed_vendor_job_is_not_an_outage():
    failed_job = Failure(Outcome.NOT_PROCESSED, code="vendor_engine_busy", message="busy", error_class="VendorJobFailed")
    assert DECIDER.decide(failed_job, situation(channel_attempts=4, in_outage=True)).action == "fail"


def test_an_open_breaker_falls_back_or_waits_for_the_breaker_without_spending_attempts():
    breaker_open = failure_of(exception="BreakerOpen")
    assert DECIDER.decide(breaker_open, situation(has_fallback=True)).action == "fall_back"
    waiting = DECIDER.decide(breaker_open, situation(breaker_retry_in_s=20, other_channels_exist=True))
    assert waiting.action == "retry" and waiting.delay_s >= 20 and waiting.waiting_reason == "breaker_open"
    assert not waiting.counts_attempt
    alone = DECIDER.decide(breaker_open, situation(breaker_retry_in_s=20))
    assert alone.waiting_reason == "all_channels_down"


def test_no_retry_is_planned_past_the_business_deadline():
    decision = DECIDER.decide(failure_of(429, retry_after_s=120), situation(time_left_s=60))
    assert decision.action == "fail" and decision.fail_code == "deadline_exceeded"
    assert "before the next try" in decision.fail_message and "rate_limited" in decision.fail_message


def test_a_dry_retry_budget_slows_retries_to_the_cap_and_still_respects_the_deadline():
    slowed = DECIDER.when_budget_dry(failure_of(503), situation(), rng=random.Random(4))
    assert slowed.action == "retry" and slowed.waiting_reason == "retry_budget_dry"
    assert POLICY.cap_s * 0.5 <= slowed.delay_s <= POLICY.cap_s and not slowed.counts_attempt
    assert DECIDER.when_budget_dry(failure_of(503), situation(time_left_s=10)).action == "fail"


def test_backoff_grows_with_attempts_under_full_jitter():
    rng = random.Random(5)
    early = [DECIDER.decide(failure_of(503), situation(channel_attempts=0), rng=rng).delay_s for _ in range(200)]
    late = [DECIDER.decide(failure_of(503), situation(channel_attempts=3), rng=rng).delay_s for _ in range(200)]
    assert max(early) <= 1.0 and max(late) <= 8.0 and sum(late) > 4 * sum(early)


def test_a_failed_duplicate_audit_is_tried_again_later_and_later_then_left_to_the_ledger():
    from tasks.services.execution.jobs import AUDIT_RETRY_S, audit_retry_delay_s

    delays = [audit_retry_delay_s(n) for n in range(1, len(AUDIT_RETRY_S) + 2)]
    assert delays[:-1] == sorted(delays[:-1]) and delays[0] > 0
    assert delays[-1] is None and audit_retry_delay_s(0) is None
