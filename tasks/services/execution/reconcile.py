"""Reconciliation: after an ambiguous failure, find out what the vendor holds for the operation
before anything is sent again."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import Any

from django.db.models import F
from django.utils import timezone

from tasks import lifecycle, timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, Task, VendorJob
from tasks.observability import log_event
from tasks.scheduling.budgets import JOB, UPLOAD, slots_release, vendor_job_terminal
from tasks.services.billing import task_billing_check
from tasks.services.execution.guard import leased
from tasks.services.execution.jobs import (
    AUDIT_FOLLOW_UP_S,
    TRANSIENT_404_WINDOW_S,
    audit_again,
    audit_duplicates,
    cancel_vendor_job,
    job_failure,
    operation_of,
    record_job,
    vendor_of,
)
from tasks.services.execution.lease import actor, worker_id
from tasks.services.execution.retry import refused, retry_or_fallback
from tasks.services.outcomes import task_move
from tasks.states import State
from tasks.vendors import breaker
from tasks.vendors.classification import Failure, Outcome
from tasks.vendors.dialects import capabilities_for
from tasks.vendors.errors import VendorError
from tasks.vendors.policies import PollPolicy, RetryPolicy
from tasks.vendors.protocol import JobView

S = State
P = Task.Phase


# Codes after which a live job is stopped (and confirmed stopped) before any new execution.
STOP_FIRST = ("execution_timeout", "poll_budget_exhausted")


def step_reconcile(task_id: Any, generation: int) -> str:
    return leased(task_id, generation, S.RECONCILING, _reconcile)


def _reconcile(task: Task) -> str:
    generation = task.generation
    channel = task.channel
    stop_first = task.error_code in STOP_FIRST
    if channel is None or not task.vendor_client_ref:
        return _reconciled_none(task, "no vendor operation was started")
    vendor = vendor_of(task)
    known = task.vendor_job
    if vendor.capabilities.can_reconcile:
        # Whatever this round finds, a create it does not see yet may still be run late.
        audit_again(task.pk, after_s=AUDIT_FOLLOW_UP_S)
    if known is None and not vendor.capabilities.can_reconcile:
        return _hold_for_operator(task)
    known_missing = False
    try:
        # A vendor that can be searched is asked for every job of the operation; one that cannot
        # is only asked about the job we know.
        jobs = vendor.find_jobs(operation_of(task)) if vendor.capabilities.can_reconcile else []
        if known and all(j.id != known.vendor_job_id for j in jobs):
            try:
                jobs.append(vendor.get_job(known.vendor_job_id))
            except VendorError as err:
                if err.status != 404:
                    raise
                known_missing = True
    except VendorError as err:
        return _reconcile_later(task, err.failure)
    if not jobs and known is not None and known_missing:
        return _vendor_lost_job(task, known)
    if not jobs:
        log_event("reconciled", task_id=task.pk, channel=channel.name, decision="none_found")
        return _reconciled_none(task, "the vendor holds no job for this operation")
    live = [j for j in jobs if j.status != "canceled" and j.status != "failed"]
    keep = _choose_job(live or jobs, task)
    for view in jobs:
        record_job(task, channel, view, adopted=True)
    if len(jobs) > 1:
        audit_duplicates(task, channel, vendor, keep_job_id=keep.id)
    record = VendorJob.objects.get(channel=channel, vendor_job_id=keep.id)
    slots_release(task.pk, JOB, reason="bound to adopted vendor job")
    log_event("reconciled", task_id=task.pk, channel=channel.name, decision="adopt", vendor_job_id=keep.id)
    if stop_first and not keep.terminal:
        VendorJob.objects.filter(pk=record.pk, cancel_requested_at__isnull=True).update(cancel_requested_at=timezone.now())
        status = cancel_vendor_job(record, vendor)
        if status not in VendorJob.TERMINAL and status != "gone":
            # Not stopped yet: a new execution starts only once this one is confirmed ended.
            task_update(task.pk, state=S.RECONCILING, generation=generation, lease_owner="", lease_expires_at=None,
                        due_at=timescale.after(PollPolicy.for_channel(channel).initial_s),
                        waiting_reason="waiting_for_vendor_cancel")
            return "waiting_for_cancel"
        if status != "completed":
            message = ("the attempt exceeded its execution timeout" if task.error_code == "execution_timeout"
                       else "the vendor did not finish within the poll budget")
            failure = Failure(Outcome.NOT_PROCESSED, code=task.error_code, message=f"{message}; its job was stopped",
                              error_class="ExecutionTimeout")
            retry_or_fallback(task, failure, source=S.RECONCILING, new_operation=True)
            return "timed_out"
        # It completed before the cancel took hold: billed and done, so it is fetched.
        keep = replace(keep, status="completed")
    if keep.status in ("failed", "canceled"):
        vendor_job_terminal(record, keep.status)
        failure = job_failure(keep)
        if keep.error_retryable or keep.status == "canceled":
            retry_or_fallback(task, failure, source=S.RECONCILING, new_operation=True)
        else:
            refused(task, source=S.RECONCILING, code=failure.code, message=failure.message)
        return "adopted_failed"
    now = timezone.now()
    poll = PollPolicy.for_channel(channel)
    lane = task.lane
    moved = task_move(
        task.pk, source=S.RECONCILING, target=S.RUNNING, generation=generation, actor=actor(),
        reason=f"reconciled: adopted vendor job {keep.id} instead of creating another",
        fields=dict(vendor_job=record, phase=P.POLL, poll_interval_s=0, due_at=now, enqueued_at=None,
                    poll_deadline_at=task.poll_deadline_at or now + timescale.delta(poll.budget_s),
                    attempt_deadline_at=now + timescale.delta(lane.execution_timeout_s),
                    lease_owner="", lease_expires_at=None, attempts=F("attempts") + 1, reconcile_rounds=0),
        data={"vendor_job_id": keep.id, "jobs_found": len(jobs)},
    )
    if moved:
        Attempt.objects.create(task=task, generation=moved.generation, owner=worker_id(), host=socket.gethostname()[:100],
                               pid=os.getpid(), channel=channel, vendor_job_id=keep.id, note="adopted after reconciliation")
    return "adopted"


def _hold_for_operator(task: Task) -> str:
    """The vendor may have created a job and cannot be searched for it (reconcile_by none): a
    resend could pay twice, so nothing is resent. An operator decides (see operator_decides)."""
    channel = task.channel
    first = task.waiting_reason != "needs_operator"
    task_update(task.pk, state=S.RECONCILING, generation=task.generation, due_at=None, enqueued_at=None,
                lease_owner="", lease_expires_at=None, waiting_reason="needs_operator")
    if first:
        lifecycle.record_event(
            task.pk, generation=task.generation, actor=actor(),
            reason=f"reconciliation needs an operator: {channel.name} ({channel.dialect}) cannot be searched for the "
                   f"operation after {task.error_code or 'an ambiguous failure'}; nothing is resent until an operator decides",
            data={"needs_operator": True, "cannot_reconcile": True, "last_error": task.error_code,
                  "client_ref": task.vendor_client_ref, "upload_ref": task.upload_id, "channel": channel.name},
        )
        log_event("needs_operator", logging.WARNING, task_id=task.pk, channel=channel.name, reason="cannot_reconcile")
    return "needs_operator"


# What an operator may decide for a task that waits for one, and what the decision asserts.
OPERATOR_DECISIONS = {
    "resend": "resend, accepting a possible duplicate",
    "not_created": "marked as not created at the vendor, then resent",
}


def operator_decides(task: Task, *, decision: str, actor_name: str) -> bool:
    """An operator's answer for a task held in RECONCILING (needs_operator): the operation is sent
    again with the same key (RETRY_WAIT, due now). `decision` says what the operator asserted:
    `not_created` (they checked the vendor: nothing exists) or `resend` (they accept that a
    second job may be billed, and reported as such if it is)."""
    if decision not in OPERATOR_DECISIONS:
        raise ValueError(f"decision must be one of {', '.join(OPERATOR_DECISIONS)}")
    if task.state != S.RECONCILING or task.waiting_reason != "needs_operator":
        return False
    moved = task_move(
        task.pk, source=S.RECONCILING, target=S.RETRY_WAIT, generation=task.generation, actor=actor_name,
        reason=f"operator {actor_name}: {OPERATOR_DECISIONS[decision]}",
        fields=dict(due_at=timezone.now(), enqueued_at=None, dispatched_at=None, lease_owner="", lease_expires_at=None,
                    reconcile_rounds=0, phase=""),
        data={"operator_decision": decision, "accepts_duplicate": decision == "resend",
              "can_reconcile": capabilities_for(task.channel).can_reconcile if task.channel else None},
    )
    if moved:
        slots_release(task.pk, JOB, UPLOAD, reason=f"operator: {decision}")
    return moved is not None


def _reconcile_later(task: Task, failure: Failure) -> str:
    """The vendor did not answer the reconciliation: back off (full jitter, capped) and count the
    rounds; past the channel's limit an operator is asked to look, and the checks go on slowly."""
    channel = task.channel
    rounds = task.reconcile_rounds + 1
    delay = RetryPolicy.for_channel(channel).delay_s(rounds, failure.retry_after_s)
    if failure.breaker_open:
        delay = max(delay, timescale.nominal(breaker.retry_in_s(channel) or 0))
    needs_operator = rounds >= channel.reconcile_max_rounds
    task_update(task.pk, state=S.RECONCILING, generation=task.generation, due_at=timescale.after(delay),
                enqueued_at=None, lease_owner="", lease_expires_at=None, reconcile_rounds=rounds,
                waiting_reason="needs_operator" if needs_operator else "reconciling")
    if rounds == channel.reconcile_max_rounds:
        lifecycle.record_event(
            task.pk, generation=task.generation, actor=actor(),
            reason=f"reconciliation needs an operator: {rounds} rounds without an answer from {channel.name}; "
                   "nothing is resent until the vendor answers or an operator decides",
            data={"needs_operator": True, "rounds": rounds, "last_error": failure.code, "error_class": failure.error_class,
                  "client_ref": task.vendor_client_ref,
                  "vendor_job_id": task.vendor_job.vendor_job_id if task.vendor_job else None},
        )
        log_event("needs_operator", logging.WARNING, task_id=task.pk, channel=channel.name, count=rounds)
    return "needs_operator" if needs_operator else "reconcile_retry"


def _vendor_lost_job(task: Task, known: VendorJob) -> str:
    """The vendor no longer knows a job it created (404, and absent from its list): it forgot it.
    No other job exists for the operation, so nothing of it is live at the vendor: it is sent
    again with the same key. The lost job was billed; that is reported as such."""
    if (timezone.now() - known.created_at).total_seconds() < timescale.seconds(TRANSIENT_404_WINDOW_S):
        return _reconcile_later(task, Failure(Outcome.AMBIGUOUS, code="job_not_visible_yet",
                                              message="the vendor does not show its new job yet"))
    VendorJob.objects.filter(pk=known.pk).update(status="lost")
    vendor_job_terminal(known, "lost")
    lifecycle.record_event(
        task.pk, generation=task.generation, actor=actor(),
        reason=f"vendor lost job {known.vendor_job_id}: it answers 404 and lists nothing for the operation; "
               "resubmitting with the same key (the lost job was billed)",
        data={"vendor_lost_job": known.vendor_job_id, "channel": known.channel_id, "amount_cents": known.amount_cents},
    )
    log_event("vendor_lost_job", logging.WARNING, task_id=task.pk, channel=known.channel_id, vendor_job_id=known.vendor_job_id)
    task_billing_check(task.pk)
    slots_release(task.pk, JOB, UPLOAD, reason="vendor lost the job")
    # A vendor that forgot its jobs forgot its uploads too: upload again rather than be told so.
    task_update(task.pk, state=S.RECONCILING, generation=task.generation, upload_id="", upload_expires_at=None)
    retry_or_fallback(task, Failure(Outcome.NOT_PROCESSED, code="vendor_lost_job", error_class="VendorLostJob",
                                    message="the vendor lost the job; the operation is sent again"),
                      source=S.RECONCILING)
    return "vendor_lost_job"


def _choose_job(jobs: list[JobView], task: Task) -> JobView:
    # Prefer the job we already know, then the oldest (the one our first request created).
    if task.vendor_job and any(j.id == task.vendor_job.vendor_job_id for j in jobs):
        return next(j for j in jobs if j.id == task.vendor_job.vendor_job_id)
    return sorted(jobs, key=lambda j: (j.created_at, j.id))[0]


def _reconciled_none(task: Task, why: str) -> str:
    slots_release(task.pk, JOB, UPLOAD, reason="reconciled: no vendor job")
    failure = Failure(Outcome.NOT_PROCESSED, code=task.error_code or "reconciled_none", message=why,
                      error_class="Reconciled")
    # Resubmit with the same key: the vendor provably holds nothing for it (after a timeout the
    # operation starts afresh).
    retry_or_fallback(task, failure, source=S.RECONCILING, new_operation=task.error_code in STOP_FIRST)
    return "none_found"
