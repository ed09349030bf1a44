"""What happens after a failure: a durable retry (maybe on another channel), a wait for any channel
to recover, reconciliation first, or failing with an actionable message."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

from django.db.models import F
from django.utils import timezone

from tasks import timescale
from tasks.models import Attempt, Task, VendorChannel
from tasks.observability import log_event
from tasks.scheduling.budgets import JOB, UPLOAD, slots_release
from tasks.services.execution.lease import actor
from tasks.services.outcomes import task_move
from tasks.states import State
from tasks.vendors import breaker
from tasks.vendors.classification import Failure
from tasks.vendors.policies import RetryPolicy

S = State
P = Task.Phase


def to_reconciling(task: Task, failure: Failure, *, operation: str = "a vendor call", source: State = S.RUNNING) -> None:
    task_move(
        task.pk, source=source, target=S.RECONCILING, generation=task.generation, actor=actor(),
        reason=f"{failure.error_class or failure.code} during {operation}: the vendor may have acted; reconcile before any retry",
        fields=dict(due_at=timezone.now(), enqueued_at=None, phase="", lease_owner="", lease_expires_at=None,
                    error_code=failure.code[:64], error_message=failure.message[:500], reconcile_rounds=0,
                    waiting_reason="reconciling"),
        attempt_outcome=Attempt.Outcome.RECONCILE, data={"error_class": failure.error_class},
    )


def fail(task: Task, *, source: State, code: str, message: str, retryable: bool = False,
         dead_letter: bool = False, data: dict | None = None, reason: str | None = None) -> bool:
    moved = task_move(
        task.pk, source=source, target=S.FAILED, generation=task.generation, actor=actor(),
        reason=reason or f"failed: {code}",
        fields=dict(error_code=code[:64], error_message=message[:500], error_retryable=retryable,
                    lease_owner="", lease_expires_at=None),
        attempt_outcome=Attempt.Outcome.FAILED, data=data,
        dead_letter_class=(data or {}).get("error_class") or "retryable" if dead_letter else None,
    )
    return moved is not None


def other_channels(task: Task, *, excluding: list[str]) -> list[VendorChannel]:
    return [
        c for c in VendorChannel.objects.filter(enabled=True).order_by("preference", "name")
        if task.kind in (c.kinds or []) and c.name not in excluding
    ]


def retry_or_fallback(task: Task, failure: Failure, *, source: State, new_operation: bool = False) -> None:
    """A provably not-processed failure (or a finished failed job): wait durably, maybe elsewhere.

    When every channel that serves the task's kind has spent its attempts and the last one could
    not take the work at all (unreachable, unavailable: provably not processed, nothing billed),
    the task waits (`all_channels_down`) at the capped backoff for any channel to recover, until
    its business deadline. Other failures (a billed job that failed, an upload that keeps timing
    out) are not retried without end: they fail with retries_exhausted."""
    channel = task.channel
    policy = RetryPolicy.for_channel(channel)
    now = timezone.now()
    fields: dict[str, Any] = dict(
        error_code=failure.code[:64], error_message=failure.message[:500], error_retryable=True, phase="",
        lease_owner="", lease_expires_at=None, dispatched_at=None, enqueued_at=None,
        last_retry_after_s=failure.retry_after_s, vendor_job=None, fetch_attempts=0, reconcile_rounds=0,
    )
    if new_operation:
        # The old job is over: the next submission is a new operation with a new key.
        fields.update(vendor_client_ref="", vendor_idempotency_key="", upload_id="", upload_expires_at=None)
    flow_control = failure.flow_control
    attempts_here = task.channel_attempts + (0 if flow_control else 1)
    spent = not flow_control and policy.exhausted(attempts_here)
    fallbacks = other_channels(task, excluding=[channel.name, *task.abandoned_channels])
    waiting = "retry_backoff"
    if failure.breaker_open and fallbacks:
        fields.update(_abandon(task, channel))
        delay_real = timescale.seconds(policy.base_s) * 0.1
        decision = f"breaker open: fall back from {channel.name}"
    elif failure.breaker_open:
        delay_real = max(breaker.retry_in_s(channel) or 0.0, timescale.seconds(policy.base_s)) * 1.1
        decision = "breaker open: wait for it"
        waiting = "all_channels_down" if not other_channels(task, excluding=[channel.name]) or task.abandoned_channels else "breaker_open"
    elif spent and not fallbacks and not failure.unavailable:
        fail(task, source=source, code="retries_exhausted",
             message=f"{failure.message}; retries on every channel are spent", retryable=True, dead_letter=True,
             data={"error_class": failure.error_class or "retryable"})
        return
    elif (spent and not fallbacks) or (task.outage_since and failure.unavailable and not flow_control):
        # Every channel failed and nothing was processed: wait for any of them to recover, one
        # try per round at the capped backoff (not a new round of fast retries per channel).
        fields.update(_abandon(task, channel), abandoned_channels=[], outage_since=task.outage_since or now)
        delay_real = timescale.seconds(policy.cap_s) * random.uniform(0.5, 1.0)
        decision = f"every channel for {task.kind} failed ({failure.code}): wait for one to recover"
        waiting = "all_channels_down"
    elif spent:
        fields.update(_abandon(task, channel))
        delay_real = timescale.seconds(policy.delay_s(0))
        decision = f"retries on {channel.name} spent: fall back"
    elif not flow_control and not breaker.take_retry_token(channel, timeout=failure.timeout):
        # The channel's retry budget is dry: slow down rather than multiply an outage's traffic.
        delay_real = timescale.seconds(policy.cap_s) * random.uniform(0.5, 1.0)
        decision = f"retry budget of {channel.name} is dry: wait {timescale.nominal(delay_real):.1f}s"
        waiting = "retry_budget_dry"
    else:
        delay_real = timescale.seconds(policy.delay_s(task.channel_attempts, failure.retry_after_s))
        fields.update(channel_attempts=attempts_here)
        decision = f"retry on {channel.name} in {timescale.nominal(delay_real):.1f}s"
        waiting = "rate_limited" if failure.code == "http_429" else "retry_backoff"
    due = now + timedelta(seconds=delay_real)
    if due >= task.deadline_at:
        fail(task, source=source, code="deadline_exceeded",
             message=f"the business deadline passes before the next try ({failure.message}; waiting: {waiting})",
             retryable=True, dead_letter=True, data={"error_class": failure.error_class or "retryable"})
        return
    fields.update(due_at=due, retries=F("retries") + 1, waiting_reason=waiting)
    task_move(
        task.pk, source=source, target=S.RETRY_WAIT, generation=task.generation, actor=actor(),
        reason=f"{failure.code}: {decision}", fields=fields, attempt_outcome=Attempt.Outcome.RETRY,
        data={"error_class": failure.error_class, "retry_after_s": failure.retry_after_s, "delay_s": round(delay_real, 3),
              "waiting_reason": waiting},
    )
    slots_release(task.pk, JOB, UPLOAD, reason="not processed: retry later")
    log_event("retry_scheduled", task_id=task.pk, channel=channel.name, code=failure.code, delay_s=round(delay_real, 3),
              retry_after_s=failure.retry_after_s, decision=decision)


def _abandon(task: Task, channel: VendorChannel) -> dict[str, Any]:
    return dict(
        abandoned_channels=[*task.abandoned_channels, channel.name], channel=None, channel_attempts=0,
        vendor_client_ref="", vendor_idempotency_key="", upload_id="", upload_expires_at=None,
    )
