"""Polling a vendor job, and fetching its result once the vendor reports it completed: a completed
job is fetched with its own retries, never abandoned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from tasks import lifecycle, timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, Task, VendorJob
from tasks.observability import log_event
from tasks.scheduling.budgets import vendor_job_terminal
from tasks.services.execution.guard import leased
from tasks.services.execution.jobs import (
    TRANSIENT_404_WINDOW_S,
    audit_duplicates,
    job_failure,
    vendor_of,
)
from tasks.services.execution.lease import actor
from tasks.services.execution.retry import fail, refused, retry_or_fallback, to_reconciling
from tasks.services.outcomes import task_move
from tasks.states import State
from tasks.storage import StorageUnavailable, attempt_result_path, discard_result, publish_result
from tasks.vendors import breaker
from tasks.vendors.classification import Failure, Outcome
from tasks.vendors.errors import VendorError
from tasks.vendors.policies import PollPolicy, RetryPolicy
from tasks.vendors.protocol import JobView

S = State
P = Task.Phase


# A result whose digest does not match may have been damaged on the way: it is downloaded again
# this many times before it is declared unusable.
DIGEST_REFETCHES = 2


def step_poll(task_id: Any, generation: int) -> str:
    return leased(task_id, generation, S.RUNNING, _poll, phase=P.POLL)


def _poll(task: Task) -> str:
    job = task.vendor_job
    vendor = vendor_of(task)
    try:
        view = vendor.get_job(job.vendor_job_id)
    except VendorError as err:
        young = (timezone.now() - job.created_at).total_seconds() < timescale.seconds(TRANSIENT_404_WINDOW_S)
        if err.status == 404 and not young:
            to_reconciling(task, err.failure, operation=err.operation)
        elif err.outcome in (Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS) or err.status == 404:
            _schedule_poll(task, retry_after_s=err.retry_after_s, error=err)
        else:
            fail(task, source=S.RUNNING, code=err.code, message=err.message)
        return "poll_error"
    return job_seen(task, job, view)


@dataclass(frozen=True)
class SoFar:
    """What the step that created a job the vendor answered finished already did with it, so
    that the same step's fetch does not do it again."""

    said: bool = False  # its completion is in the task's history (with the job's creation)
    audited: bool = False  # the operation's jobs were listed since the create
    attempt: dict[str, Any] = field(default_factory=dict)  # the attempt's fields not written yet: with its end


NOTHING_YET = SoFar()


def job_seen(task: Task, job: VendorJob, view: JobView, *, so_far: SoFar = NOTHING_YET) -> str:
    """What the vendor says of the task's job (a poll's answer, or the create's when it already
    says how the job ended): a finished job is fetched or its failure handled in this step."""
    if view.status != job.status:
        VendorJob.objects.filter(pk=job.pk).update(status=view.status)
        if view.status == "processing":
            # When the vendor began: the "vendor queued" and "vendor processing" stages split here.
            lifecycle.record_event(task.pk, generation=task.generation, actor=actor(),
                                   reason="the vendor is processing the job", data={"vendor_status": "processing"})
    if not view.terminal:
        _schedule_poll(task)
        return view.status
    if job.terminal_at is None:
        vendor_job_terminal(job, view.status)
    if view.status == "completed":
        return _completed(task, job, view, so_far=so_far)
    failure = job_failure(view)
    if view.status == "failed" and not view.error_retryable:
        refused(task, source=S.RUNNING, code=failure.code, message=failure.message)
        return "failed"
    retry_or_fallback(task, failure, source=S.RUNNING, new_operation=True)
    return "failed" if view.status == "failed" else "canceled_at_vendor"


def _schedule_poll(task: Task, *, retry_after_s: float | None = None, error: VendorError | None = None) -> None:
    channel = task.channel
    policy = PollPolicy.for_channel(channel)
    now = timezone.now()
    if task.poll_deadline_at and now >= task.poll_deadline_at:
        _poll_budget_spent(task)
        return
    interval = policy.next_interval_s(task.poll_interval_s)
    delay = policy.jittered(interval)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, RetryPolicy.for_channel(channel).retry_after_cap_s))
    if error is not None and error.error_class == "BreakerOpen":
        delay = max(delay, timescale.nominal(breaker.retry_in_s(channel) or 0))
    task_update(
        task.pk, state=S.RUNNING, generation=task.generation, poll_interval_s=interval,
        due_at=now + timescale.delta(delay), lease_owner="", lease_expires_at=None,
    )


def _poll_budget_spent(task: Task) -> None:
    """The vendor is still working after the poll budget: stop its job (and confirm it stopped)
    before anything new starts. If it completes meanwhile, reconciliation adopts and fetches it."""
    to_reconciling(task, Failure(Outcome.NOT_PROCESSED, code="poll_budget_exhausted", error_class="PollBudget",
                                 message="the vendor did not finish within the poll budget"), operation="polling")


def step_fetch(task_id: Any, generation: int) -> str:
    return leased(task_id, generation, S.RUNNING, _fetch, phase=P.FETCH)


def _completed(task: Task, job: VendorJob, view: JobView, *, so_far: SoFar = NOTHING_YET) -> str:
    """The vendor reports the job completed (and billed it): from here on it is fetched, never
    abandoned — only the business deadline or a refusal ends the download's retries."""
    if view.input_sha256 and view.input_sha256 != task.file.sha256:
        VendorJob.objects.filter(pk=job.pk).update(integrity_flag="input_digest_mismatch")
        return _integrity_failure(task, "the vendor processed a different input than ours (sha256 mismatch)")
    if (job.result_sha256, job.result_size) != (view.result_sha256 or "", view.result_size):
        VendorJob.objects.filter(pk=job.pk).update(result_sha256=view.result_sha256 or "", result_size=view.result_size)
        job.result_sha256, job.result_size = view.result_sha256 or "", view.result_size
    if not so_far.said:
        lifecycle.record_event(task.pk, generation=task.generation, actor=actor(), reason="the vendor completed the job",
                               data={"vendor_status": "completed"})
    if task.phase != P.FETCH or task.fetch_attempts:
        task_update(task.pk, state=S.RUNNING, generation=task.generation, phase=P.FETCH, fetch_attempts=0)
    task.phase, task.fetch_attempts = P.FETCH, 0
    return _fetch(task, so_far=so_far)


def _fetch(task: Task, *, so_far: SoFar = NOTHING_YET) -> str:
    """Download the completed job's result, check it, and end the task with it. Before the move,
    the operation's jobs are listed for duplicates, unless this step did so since the create
    (the job was created finished, milliseconds ago)."""
    g = task.generation
    job = task.vendor_job
    vendor = vendor_of(task)
    dest = attempt_result_path(task.pk, g)
    try:
        fetched = vendor.fetch_result(job.vendor_job_id, dest, target_format=task.target_format)
    except VendorError as err:
        dest.unlink(missing_ok=True)
        if err.status == 404:
            # The vendor no longer knows the job it said was completed: find out what it holds.
            to_reconciling(task, err.failure, operation=err.operation)
            return "fetch_gone"
        if err.status == 410:
            retry_or_fallback(task, Failure(Outcome.NOT_PROCESSED, code="result_expired", message=err.message,
                                            error_class=err.error_class),
                              source=S.RUNNING, new_operation=True)
            return "result_expired"
        if err.outcome in (Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS) or err.status == 409:
            _schedule_fetch(task, err.failure)
            return "fetch_retry"
        fail(task, source=S.RUNNING, code=err.code, message=err.message)
        return "fetch_failed"
    expected = [d for d in (job.result_sha256, fetched.declared_sha256) if d]
    if any(d.lower() != fetched.sha256 for d in expected):
        dest.unlink(missing_ok=True)
        if task.fetch_attempts < DIGEST_REFETCHES:
            # It may have been damaged on the way: download it again before giving the result up.
            _schedule_fetch(task, Failure(Outcome.NOT_PROCESSED, code="result_digest_mismatch",
                                          message="the downloaded result does not match its declared sha256"))
            return "fetch_retry"
        VendorJob.objects.filter(pk=job.pk).update(integrity_flag="result_digest_mismatch")
        return _integrity_failure(task, "the result's sha256 does not match what the vendor declared")
    if not so_far.audited:
        audit_duplicates(task, task.channel, vendor, keep_job_id=job.vendor_job_id)
    try:
        relative = publish_result(dest)
    except StorageUnavailable as exc:
        dest.unlink(missing_ok=True)
        _schedule_fetch(task, Failure(Outcome.NOT_PROCESSED, code="result_store_unavailable", message=str(exc)))
        return "fetch_retry"
    moved = task_move(
        task.pk, source=S.RUNNING, target=S.SUCCEEDED, generation=g, actor=actor(), reason="result fetched and verified",
        fields=dict(result_path=relative, result_sha256=fetched.sha256, result_size=fetched.size,
                    result_content_type=fetched.content_type[:100], lease_owner="", lease_expires_at=None,
                    error_code="", error_message=""),
        attempt_outcome=Attempt.Outcome.SUCCEEDED, attempt_fields=so_far.attempt,
        data={"vendor_job_id": job.vendor_job_id, "sha256": fetched.sha256},
    )
    breaker.refund_retry_token(task.channel)
    if moved is None:
        # Someone else moved the task first (a cancel, a fence): this late result is discarded.
        dest.unlink(missing_ok=True)
        try:
            discard_result(relative)
        except StorageUnavailable:
            pass  # unreferenced: the orphan sweep removes it once the store answers
        current = Task.objects.filter(pk=task.pk).values_list("state", "generation").first()
        lifecycle.record_event(
            task.pk, generation=current[1] if current else g, actor=actor(),
            reason=f"late result discarded: the task was already {current[0] if current else 'gone'}",
            data={"vendor_job_id": job.vendor_job_id},
        )
        if current and current[0] == S.CANCEL_REQUESTED:
            Task.objects.filter(pk=task.pk, state=S.CANCEL_REQUESTED).update(due_at=timezone.now())
        return "discarded"
    try:
        vendor.release(job.vendor_job_id)  # the result is ours now: the vendor's copies can go
    except VendorError as err:
        log_event("vendor_release_failed", task_id=task.pk, channel=task.channel_id, reason=err.code)
    return "succeeded"


def _schedule_fetch(task: Task, failure: Failure) -> None:
    """Download again: after Retry-After when told, else a capped full-jitter backoff; the poll
    interval is untouched (the job is done, only the download failed)."""
    channel = task.channel
    policy = RetryPolicy.for_channel(channel)
    attempt = task.fetch_attempts + 1
    delay = policy.delay_s(attempt, failure.retry_after_s)
    if failure.breaker_open:
        delay = max(delay, timescale.nominal(breaker.retry_in_s(channel) or 0))
    due = timescale.after(delay)
    if due >= task.deadline_at:
        fail(task, source=S.RUNNING, code="deadline_exceeded", retryable=True, dead_letter=True,
             message=f"the result could not be downloaded before the business deadline ({failure.message})",
             data={"error_class": failure.error_class or "retryable"})
        return
    # The vendor's part is over: waiting for the download is no execution running long. The
    # attempt lasts at least until this download has had its own full deadline (else the
    # watchdog would fence a finished job back to polling, and the download would be cut short).
    download_ends = due + timescale.delta(channel.result_timeout_s)
    attempt_deadline = max(task.attempt_deadline_at, download_ends) if task.attempt_deadline_at else None
    task_update(task.pk, state=S.RUNNING, generation=task.generation, phase=P.FETCH, fetch_attempts=attempt,
                due_at=due, enqueued_at=None, lease_owner="", lease_expires_at=None, attempt_deadline_at=attempt_deadline,
                waiting_reason="result_rate_limited" if failure.code == "http_429" else "result_download_retry")
    log_event("fetch_retry", task_id=task.pk, channel=channel.name, code=failure.code, delay_s=round(delay, 3),
              retry_after_s=failure.retry_after_s)


def _integrity_failure(task: Task, message: str) -> str:
    failure = Failure(Outcome.NOT_PROCESSED, code="integrity_error", message=message, error_class="IntegrityError")
    retry_or_fallback(task, failure, source=S.RUNNING, new_operation=True)
    return "integrity_error"
