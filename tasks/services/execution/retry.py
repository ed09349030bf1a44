"""What happens after a failure: a durable retry (maybe on another channel), a wait for any channel
to recover, reconciliation first, or failing with an actionable message."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from tasks import engine, locks, timescale
from tasks.models import Attempt, Task, VendorChannel
from tasks.observability import log_event
from tasks.scheduling.budgets import JOB, UPLOAD, slots_release
from tasks.scheduling.channels import serves
from tasks.services.execution.lease import actor
from tasks.services.outcomes import task_move
from tasks.services.quarantine import LOCAL, poison_check
from tasks.states import State
from tasks.vendors import breaker
from tasks.vendors.classification import Failure
from tasks.vendors.policies import RetryDecider, RetryPolicy, RetrySituation

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


def refused(task: Task, *, source: State, code: str, message: str, data: dict | None = None) -> None:
    """The vendor refused the work for good (a create it refused, a job it ended failed, however
    that is learnt: a create's answer, a poll, reconciliation): the task fails and the failure
    counts towards quarantining its content as poison. The move and the verdict commit together:
    a worker that dies between them would leave content that failed three times unquarantined
    until it fails again. Failures of one content are judged one at a time (each counts the
    others' committed moves); the engine's version, a subprocess, is read before the write."""
    converter = engine.engine_version() if task.channel_id == LOCAL else None
    with transaction.atomic():
        if fail(task, source=source, code=code, message=message, data=data):
            locks.hold(("poison-verdict", task.tenant_id, task.file.sha256))
            poison_check(task=task, engine_version=converter)


def other_channels(task: Task, *, excluding: list[str]) -> list[VendorChannel]:
    return [
        c for c in VendorChannel.objects.filter(enabled=True).order_by("preference", "name")
        if serves(c, task.kind) and c.name not in excluding
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
    fallbacks = other_channels(task, excluding=[channel.name, *task.abandoned_channels])
    breaker_wait = breaker.retry_in_s(channel) if failure.breaker_open else None
    situation = RetrySituation(
        channel=channel.name, kind=task.kind, channel_attempts=task.channel_attempts,
        time_left_s=timescale.nominal((task.deadline_at - now).total_seconds()), has_fallback=bool(fallbacks),
        other_channels_exist=bool(other_channels(task, excluding=[channel.name])),
        abandoned_any=bool(task.abandoned_channels), in_outage=task.outage_since is not None,
        breaker_retry_in_s=timescale.nominal(breaker_wait) if breaker_wait is not None else None,
    )
    decider = RetryDecider(policy)
    decision = decider.decide(failure, situation)
    if decision.needs_retry_token and not breaker.take_retry_token(channel, timeout=failure.timeout):
        decision = decider.when_budget_dry(failure, situation)
    if decision.action == "fail":
        fail(task, source=source, code=decision.fail_code, message=decision.fail_message, retryable=True,
             dead_letter=True, data={"error_class": failure.error_class or "retryable"})
        return
    if decision.action == "fall_back":
        fields.update(_abandon(task, channel))
    elif decision.action == "wait_for_channels":
        # One try per round at the capped backoff, on whichever channel is up then.
        fields.update(_abandon(task, channel), abandoned_channels=[], outage_since=task.outage_since or now)
    elif decision.counts_attempt:
        fields.update(channel_attempts=task.channel_attempts + 1)
    delay_real = timescale.seconds(decision.delay_s)
    waiting = decision.waiting_reason or "retry_backoff"
    due = now + timedelta(seconds=delay_real)
    fields.update(due_at=due, retries=F("retries") + 1, waiting_reason=waiting)
    task_move(
        task.pk, source=source, target=S.RETRY_WAIT, generation=task.generation, actor=actor(),
        reason=f"{failure.code}: {decision.summary}", fields=fields, attempt_outcome=Attempt.Outcome.RETRY,
        data={"error_class": failure.error_class, "retry_after_s": failure.retry_after_s, "delay_s": round(delay_real, 3),
              "waiting_reason": waiting},
    )
    slots_release(task.pk, JOB, UPLOAD, reason="not processed: retry later")
    log_event("retry_scheduled", task_id=task.pk, channel=channel.name, code=failure.code, delay_s=round(delay_real, 3),
              retry_after_s=failure.retry_after_s, decision=decision.summary)


def _abandon(task: Task, channel: VendorChannel) -> dict[str, Any]:
    return dict(
        abandoned_channels=[*task.abandoned_channels, channel.name], channel=None, channel_attempts=0,
        vendor_client_ref="", vendor_idempotency_key="", upload_id="", upload_expires_at=None,
    )
