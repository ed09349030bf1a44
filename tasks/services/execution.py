"""The steps a worker runs for a task: start (claim + upload + create), poll, reconcile, cancel.

Each step is a short django-q2 task. Between steps nothing holds a worker: the task row says what
is due next (`due_at`) and the dispatcher sends the next message. A step first takes a lease on
the task at its current (state, generation); every write afterwards is a compare-and-set on that
generation, so a step that was fenced (watchdog, cancel, deadline) can no longer change anything.
No vendor call happens inside a transaction.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks import lifecycle, timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, Task, VendorChannel, VendorJob
from tasks.observability import log_event
from tasks.scheduling.budgets import JOB, UPLOAD, slots_release, vendor_job_terminal
from tasks.services.outcomes import task_move
from tasks.states import TERMINAL_STATES, State
from tasks.storage import attempt_result_path, relative_result
from tasks.vendor import breaker
from tasks.vendor.classification import Failure, Outcome
from tasks.vendor.client import Created, JobView, VendorClient
from tasks.vendor.errors import StopUpload, VendorError
from tasks.vendor.policies import PollPolicy, RetryPolicy

S = State
P = Task.Phase
# A job that answers 404 this soon after we created it is "not visible yet", not gone.
TRANSIENT_404_WINDOW_S = 30.0
# A result whose digest does not match may have been damaged on the way: it is downloaded again
# this many times before it is declared unusable.
DIGEST_REFETCHES = 2


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def actor() -> str:
    return f"worker {worker_id()}"


def lease_seconds() -> float:
    return max(timescale.seconds(settings.LEASE_S), settings.LEASE_FLOOR_S)


class Lease:
    """The right to run one step of a task at (state, generation), renewed by heartbeats."""

    def __init__(self, task: Task) -> None:
        self.task_id = task.pk
        self.state = task.state
        self.generation = task.generation
        self.owner = worker_id()
        self._next_renewal = 0.0

    @classmethod
    def claim(cls, task: Task) -> Lease | None:
        lease = cls(task)
        now = timezone.now()
        taken = Task.objects.filter(
            Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now),
            pk=task.pk, state=task.state, generation=task.generation,
        ).update(lease_owner=lease.owner, lease_expires_at=now + timedelta(seconds=lease_seconds()))
        if not taken:
            return None
        lease._next_renewal = time.monotonic() + lease_seconds() / 3
        return lease

    @classmethod
    def adopt(cls, task: Task) -> Lease:
        """The lease written by the claim transition itself."""
        lease = cls(task)
        lease._next_renewal = time.monotonic() + lease_seconds() / 3
        return lease

    def heartbeat(self, _bytes: int = 0) -> None:
        """Renew between upload chunks; stop if the task was fenced or cancelled meanwhile."""
        if time.monotonic() < self._next_renewal:
            return
        now = timezone.now()
        expires = now + timedelta(seconds=lease_seconds())
        renewed = Task.objects.filter(
            pk=self.task_id, state=self.state, generation=self.generation, lease_owner=self.owner
        ).update(lease_expires_at=expires)
        if not renewed:
            raise StopUpload()
        Attempt.objects.filter(task_id=self.task_id, generation=self.generation).update(
            heartbeat_at=now, lease_expires_at=expires
        )
        self._next_renewal = time.monotonic() + lease_seconds() / 3

    def release(self) -> None:
        Task.objects.filter(pk=self.task_id, lease_owner=self.owner).update(lease_owner="", lease_expires_at=None)


def _load(task_id: Any) -> Task | None:
    return Task.objects.select_related("channel", "file", "lane", "vendor_job").filter(pk=task_id).first()


# --- start: claim, upload, create ------------------------------------------------------------
def step_start(task_id: Any, generation: int) -> str:
    task = _load(task_id)
    if task is None or task.state != S.QUEUED or task.generation != generation or task.dispatched_at is None:
        return "stale"
    now = timezone.now()
    lease_expires = now + timedelta(seconds=lease_seconds())
    moved = lifecycle.transition(
        task.pk, source=S.QUEUED, target=S.RUNNING, generation=generation, actor=actor(), reason="claimed by a worker",
        fields=dict(
            started_at=task.started_at or now, phase=P.UPLOAD if task.channel.mode == "two_step" else P.CREATE,
            lease_owner=worker_id(), lease_expires_at=lease_expires, attempts=F("attempts") + 1,
            attempt_deadline_at=now + timescale.delta(task.lane.execution_timeout_s), due_at=None, enqueued_at=None,
        ),
        data={"channel": task.channel_id, "queue_wait_s": round((now - (task.queued_at or task.created_at)).total_seconds(), 3)},
    )
    if moved is None:
        return "lost_claim"
    host, pid = socket.gethostname(), os.getpid()
    Attempt.objects.create(
        task=task, generation=moved.generation, owner=worker_id(), host=host[:100], pid=pid,
        lease_expires_at=lease_expires, heartbeat_at=now, channel=task.channel,
    )
    task.refresh_from_db()
    lease = Lease.adopt(task)
    try:
        submit(task, lease)
    except Exception as exc:
        step_crashed(task, exc)
        return "crashed"
    finally:
        lease.release()
    return "started"


def submit(task: Task, lease: Lease) -> None:
    """Upload (two-step) and create the vendor job with the key persisted at dispatch."""
    g = task.generation
    channel = task.channel
    client = VendorClient(channel, task_id=task.pk, generation=g)
    file = task.file
    stage = "create"
    started = time.monotonic()
    try:
        if channel.mode == VendorChannel.Mode.TWO_STEP:
            if not task.upload_id or _expired(task.upload_expires_at):
                stage = "upload"
                receipt = client.upload(file.path, size=file.size, sha256=file.sha256, on_chunk=lease.heartbeat,
                                        client_ref=task.vendor_client_ref)
                expires = parse_datetime(receipt.expires_at) if receipt.expires_at else None
                if not task_update(task.pk, state=S.RUNNING, generation=g, upload_id=receipt.upload_id,
                                   upload_expires_at=expires, phase=P.CREATE):
                    raise StopUpload()
                task.upload_id = receipt.upload_id
                stage = "create"
            slots_release(task.pk, UPLOAD, reason="upload done")
            created = client.create_job(
                kind=task.kind, target_format=task.target_format, client_ref=task.vendor_client_ref,
                idempotency_key=task.vendor_idempotency_key, options=task.params, upload_id=task.upload_id,
                callback_url=vendor_callback_url(channel),
            )
        else:
            created = client.create_job(
                kind=task.kind, target_format=task.target_format, client_ref=task.vendor_client_ref,
                idempotency_key=task.vendor_idempotency_key, options=task.params, inline_path=file.path,
                size=file.size, sha256=file.sha256, on_chunk=lease.heartbeat, callback_url=vendor_callback_url(channel),
            )
    except StopUpload:
        slots_release(task.pk, UPLOAD, reason="upload stopped")
        lease.release()
        log_event("upload_stopped", task_id=task.pk, generation=g, reason="fenced or cancel requested")
        return
    except VendorError as err:
        hold = upload_drain_s(channel) if err.bytes_sent and err.outcome == Outcome.AMBIGUOUS else 0.0
        slots_release(task.pk, UPLOAD, reason="upload ended", hold_s=hold)
        Attempt.objects.filter(task=task, generation=g).update(upload_ms=int((time.monotonic() - started) * 1000))
        _submit_failed(task, err, stage=stage)
        return
    slots_release(task.pk, UPLOAD, reason="upload done")
    Attempt.objects.filter(task=task, generation=g).update(
        upload_ms=int((time.monotonic() - started) * 1000), vendor_job_id=created.job.id
    )
    _job_created(task, created)
    if channel.audit_after_create:
        # A vendor that ignores keys or double-creates is caught while the extras can be stopped.
        audit_duplicates(task, channel, client, keep_job_id=created.job.id)


def vendor_callback_url(channel: VendorChannel) -> str | None:
    """Signed vendor callbacks, when this installation is reachable and the channel has a secret."""
    if not settings.PUBLIC_URL or not channel.webhook_secret:
        return None
    return f"{settings.PUBLIC_URL.rstrip('/')}/api/v1/vendor-callbacks/{channel.name}"


def upload_drain_s(channel: VendorChannel) -> float:
    """How long an abandoned upload may keep the vendor busy: what our socket buffers still held
    (the client's send buffer, see client.SEND_BUFFER) at the channel's bandwidth estimate."""
    from tasks.vendor.client import SEND_BUFFER

    return timescale.seconds(4 * SEND_BUFFER / max(channel.upload_bandwidth_bytes_s, 1.0))


def _expired(moment: datetime | None) -> bool:
    return moment is not None and moment <= timezone.now() + timescale.delta(60)


def _record_job(task: Task, channel: VendorChannel, view: JobView, *, adopted: bool, duplicate_of: VendorJob | None = None) -> VendorJob:
    """A job exists at the vendor: record it whatever happens to the task (it holds budget, and it
    was billed: a second job of the same task is reported at once)."""
    job, created = VendorJob.objects.get_or_create(
        channel=channel, vendor_job_id=view.id,
        defaults=dict(
            task=task, client_ref=view.client_ref or task.vendor_client_ref, idempotency_key=task.vendor_idempotency_key,
            status=view.status, adopted=adopted, duplicate_of=duplicate_of, billing_units=view.billing_units,
            billing_unit=view.billing_unit or "", amount_cents=view.amount_cents, input_sha256=view.input_sha256,
            result_sha256=view.result_sha256 or "", result_size=view.result_size,
        ),
    )
    if view.terminal:
        vendor_job_terminal(job, view.status)
    if created:
        from tasks.services.billing import task_billing_check

        task_billing_check(task.pk)
    return job


def _job_created(task: Task, created: Created) -> None:
    g = task.generation
    channel = task.channel
    job = _record_job(task, channel, created.job, adopted=False)
    slots_release(task.pk, JOB, reason="bound to vendor job")
    breaker.refund_retry_token(channel)
    poll = PollPolicy.for_channel(channel)
    first = poll.next_interval_s(0)
    now = timezone.now()
    updated = task_update(
        task.pk, state=S.RUNNING, generation=g, vendor_job=job, phase=P.POLL, poll_interval_s=first, outage_since=None,
        due_at=now + timescale.delta(poll.jittered(first)), poll_deadline_at=now + timescale.delta(poll.budget_s),
        lease_owner="", lease_expires_at=None, error_code="", error_message="",
    )
    lifecycle.record_event(
        task.pk, generation=g, actor=actor(),
        reason="vendor job replayed by idempotency key" if created.replayed else "vendor job created",
        data={"vendor_job_id": created.job.id, "channel": channel.name},
    )
    if not updated:
        # Fenced while creating: the job is recorded; whoever moved the task decides its fate.
        orphan_check(job)


def _submit_failed(task: Task, err: VendorError, *, stage: str) -> None:
    failure = err.failure
    if stage == "upload" and failure.outcome == Outcome.AMBIGUOUS:
        # Uploads are never billed: a broken upload is simply sent again.
        failure = replace(failure, outcome=Outcome.NOT_PROCESSED)
    if err.code == "upload_not_found":
        task_update(task.pk, state=S.RUNNING, generation=task.generation, upload_id="", upload_expires_at=None)
    if failure.outcome == Outcome.NOT_PROCESSED:
        retry_or_fallback(task, failure, source=S.RUNNING)
    elif failure.outcome == Outcome.AMBIGUOUS and settings.UNSAFE_SKIP_RECONCILIATION:
        retry_or_fallback(task, failure, source=S.RUNNING, new_operation=True)
    elif failure.outcome == Outcome.AMBIGUOUS:
        to_reconciling(task, failure, operation=err.operation)
    elif failure.outcome == Outcome.ALARM:
        log_event("idempotency_alarm", logging.ERROR, task_id=task.pk, channel=task.channel_id, code=err.code)
        fail(task, source=S.RUNNING, code=err.code, message=f"{err.message}: our bug or the vendor's; investigate",
             data={"alarm": True, "error_class": err.error_class})
    else:
        fail(task, source=S.RUNNING, code=err.code, message=err.message, data={"error_class": err.error_class})
        from tasks.services.quarantine import poison_check

        poison_check(task=task)


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


# --- steps under a lease ------------------------------------------------------------------------
def _leased(task_id: Any, generation: int, state: State, body, *, phase: str | None = None) -> str:
    """Run one step under a lease on the task at (state, generation); a stale message does nothing."""
    task = _load(task_id)
    if task is None or task.state != state or task.generation != generation or (phase and task.phase != phase):
        return "stale"
    lease = Lease.claim(task)
    if lease is None:
        return "busy"
    try:
        return body(task)
    except Exception as exc:
        step_crashed(task, exc)
        return "crashed"
    finally:
        lease.release()


def step_crashed(task: Task, exc: BaseException) -> None:
    """A bug, or an answer nobody foresaw, must not leave the task without a lease and a due time:
    a create that may have happened is reconciled, anything else is tried again later."""
    log_event("step_crashed", logging.ERROR, task_id=task.pk, generation=task.generation, reason=type(exc).__name__)
    row = Task.objects.filter(pk=task.pk).values("state", "generation", "phase", "due_at").first()
    if row is None or row["state"] in TERMINAL_STATES or row["due_at"] is not None:
        return
    current = Task.objects.select_related("channel").get(pk=task.pk)
    failure = Failure(Outcome.AMBIGUOUS, code="step_crashed", message=f"the step failed unexpectedly ({type(exc).__name__})",
                      error_class=type(exc).__name__)
    if current.state == S.RUNNING and current.phase in (P.UPLOAD, P.CREATE, ""):
        to_reconciling(current, failure, operation="a step")
        return
    task_update(current.pk, state=current.state, generation=current.generation, enqueued_at=None,
                due_at=timescale.after(RetryPolicy().cap_s * random.uniform(0.5, 1.0)))


# --- poll -----------------------------------------------------------------------------------------
def step_poll(task_id: Any, generation: int) -> str:
    return _leased(task_id, generation, S.RUNNING, _poll, phase=P.POLL)


def _poll(task: Task) -> str:
    job = task.vendor_job
    client = VendorClient(task.channel, task_id=task.pk, generation=task.generation)
    try:
        view = client.get_job(job.vendor_job_id)
    except VendorError as err:
        young = (timezone.now() - job.created_at).total_seconds() < timescale.seconds(TRANSIENT_404_WINDOW_S)
        if err.status == 404 and not young:
            to_reconciling(task, err.failure, operation=err.operation)
        elif err.outcome in (Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS) or err.status == 404:
            _schedule_poll(task, retry_after_s=err.retry_after_s, error=err)
        else:
            fail(task, source=S.RUNNING, code=err.code, message=err.message)
        return "poll_error"
    VendorJob.objects.filter(pk=job.pk).update(status=view.status)
    if not view.terminal:
        _schedule_poll(task)
        return view.status
    vendor_job_terminal(job, view.status)
    if view.status == "completed":
        return _completed(task, job, view)
    failure = _job_failure(view)
    if view.status == "failed" and not view.error_retryable:
        fail(task, source=S.RUNNING, code=failure.code, message=failure.message)
        from tasks.services.quarantine import poison_check

        poison_check(task=task)
        return "failed"
    retry_or_fallback(task, failure, source=S.RUNNING, new_operation=True)
    return "failed" if view.status == "failed" else "canceled_at_vendor"


def _job_failure(view: JobView) -> Failure:
    outcome = Outcome.NOT_PROCESSED if view.error_retryable or view.status == "canceled" else Outcome.REFUSED
    return Failure(outcome, code=f"vendor_{view.error_code or view.status}"[:64],
                   message=view.error_message or f"the vendor job ended {view.status}", error_class="VendorJobFailed")


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


# --- fetch ------------------------------------------------------------------------------------------
def step_fetch(task_id: Any, generation: int) -> str:
    return _leased(task_id, generation, S.RUNNING, _fetch, phase=P.FETCH)


def _completed(task: Task, job: VendorJob, view: JobView) -> str:
    """The vendor reports the job completed (and billed it): from here on it is fetched, never
    abandoned — only the business deadline or a refusal ends the download's retries."""
    if view.input_sha256 and view.input_sha256 != task.file.sha256:
        VendorJob.objects.filter(pk=job.pk).update(integrity_flag="input_digest_mismatch")
        return _integrity_failure(task, "the vendor processed a different input than ours (sha256 mismatch)")
    VendorJob.objects.filter(pk=job.pk).update(result_sha256=view.result_sha256 or "", result_size=view.result_size)
    job.result_sha256 = view.result_sha256 or ""
    task_update(task.pk, state=S.RUNNING, generation=task.generation, phase=P.FETCH, fetch_attempts=0)
    task.phase, task.fetch_attempts = P.FETCH, 0
    return _fetch(task)


def _fetch(task: Task) -> str:
    g = task.generation
    job = task.vendor_job
    client = VendorClient(task.channel, task_id=task.pk, generation=g)
    dest = attempt_result_path(task.pk, g)
    try:
        fetched = client.fetch_result(job.vendor_job_id, dest)
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
    audit_duplicates(task, task.channel, client, keep_job_id=job.vendor_job_id)
    moved = task_move(
        task.pk, source=S.RUNNING, target=S.SUCCEEDED, generation=g, actor=actor(), reason="result fetched and verified",
        fields=dict(result_path=relative_result(dest), result_sha256=fetched.sha256, result_size=fetched.size,
                    result_content_type=fetched.content_type[:100], lease_owner="", lease_expires_at=None,
                    error_code="", error_message=""),
        attempt_outcome=Attempt.Outcome.SUCCEEDED, data={"vendor_job_id": job.vendor_job_id, "sha256": fetched.sha256},
    )
    breaker.refund_retry_token(task.channel)
    if moved is None:
        # Someone else moved the task first (a cancel, a fence): this late result is discarded.
        dest.unlink(missing_ok=True)
        current = Task.objects.filter(pk=task.pk).values_list("state", "generation").first()
        lifecycle.record_event(
            task.pk, generation=current[1] if current else g, actor=actor(),
            reason=f"late result discarded: the task was already {current[0] if current else 'gone'}",
            data={"vendor_job_id": job.vendor_job_id},
        )
        if current and current[0] == S.CANCEL_REQUESTED:
            Task.objects.filter(pk=task.pk, state=S.CANCEL_REQUESTED).update(due_at=timezone.now())
        return "discarded"
    from tasks.services.billing import task_billing_check

    task_billing_check(task.pk)
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
    task_update(task.pk, state=S.RUNNING, generation=task.generation, phase=P.FETCH, fetch_attempts=attempt,
                due_at=due, enqueued_at=None, lease_owner="", lease_expires_at=None,
                waiting_reason="result_rate_limited" if failure.code == "http_429" else "result_download_retry")
    log_event("fetch_retry", task_id=task.pk, channel=channel.name, code=failure.code, delay_s=round(delay, 3),
              retry_after_s=failure.retry_after_s)


def _integrity_failure(task: Task, message: str) -> str:
    failure = Failure(Outcome.NOT_PROCESSED, code="integrity_error", message=message, error_class="IntegrityError")
    retry_or_fallback(task, failure, source=S.RUNNING, new_operation=True)
    return "integrity_error"


def audit_duplicates(task: Task, channel: VendorChannel, client: VendorClient, *, keep_job_id: str) -> int:
    """List the operation's jobs: more than one means the vendor ignored our key. Cancel the extras."""
    client_ref = task.vendor_client_ref
    if not client_ref:
        return 0
    try:
        jobs = client.list_jobs(client_ref)
    except VendorError:
        return 0
    extras = [j for j in jobs if j.id != keep_job_id]
    if not extras:
        return 0
    keep = VendorJob.objects.filter(channel=channel, vendor_job_id=keep_job_id).first()
    for view in extras:
        record = _record_job(task, channel, view, adopted=True, duplicate_of=keep)
        VendorJob.objects.filter(pk=record.pk).update(duplicate_of=keep)
        if not view.terminal:
            VendorJob.objects.filter(pk=record.pk).update(cancel_requested_at=timezone.now())
            cancel_vendor_job(record, client)
    from tasks.services.billing import task_billing_check

    task_billing_check(task.pk)
    return len(extras)


def cancel_vendor_job(job: VendorJob, client: VendorClient | None = None) -> str | None:
    """Ask the vendor to stop a job; returns the status it reports (None if unreachable)."""
    client = client or VendorClient(job.channel, task_id=job.task_id)
    try:
        view = client.cancel_job(job.vendor_job_id)
    except VendorError as err:
        if err.code == "already_finished" or err.status == 409:
            try:
                view = client.get_job(job.vendor_job_id)
            except VendorError:
                return None
        elif err.status == 404:
            vendor_job_terminal(job, "gone")
            return "gone"
        else:
            return None
    VendorJob.objects.filter(pk=job.pk).update(status=view.status)
    if view.terminal:
        vendor_job_terminal(job, view.status)
    return view.status


def orphan_check(job: VendorJob) -> None:
    """A job whose task no longer wants it (finished, cancelled) is cancelled at the vendor."""
    task = Task.objects.filter(pk=job.task_id).values("state", "vendor_job_id").first()
    if task and task["state"] in (S.SUCCEEDED, S.FAILED, S.CANCELLED, S.EXPIRED) and task["vendor_job_id"] != job.pk:
        VendorJob.objects.filter(pk=job.pk, terminal_at__isnull=True).update(cancel_requested_at=timezone.now())


# --- reconcile --------------------------------------------------------------------------------
# Codes after which a live job is stopped (and confirmed stopped) before any new execution.
STOP_FIRST = ("execution_timeout", "poll_budget_exhausted")


def step_reconcile(task_id: Any, generation: int) -> str:
    return _leased(task_id, generation, S.RECONCILING, _reconcile)


def _reconcile(task: Task) -> str:
    generation = task.generation
    channel = task.channel
    stop_first = task.error_code in STOP_FIRST
    if channel is None or not task.vendor_client_ref:
        return _reconciled_none(task, "no vendor operation was started")
    client = VendorClient(channel, task_id=task.pk, generation=generation)
    known = task.vendor_job
    known_missing = False
    try:
        jobs = client.list_jobs(task.vendor_client_ref)
        if known and all(j.id != known.vendor_job_id for j in jobs):
            try:
                jobs.append(client.get_job(known.vendor_job_id))
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
        _record_job(task, channel, view, adopted=True)
    if len(jobs) > 1:
        audit_duplicates(task, channel, client, keep_job_id=keep.id)
    record = VendorJob.objects.get(channel=channel, vendor_job_id=keep.id)
    slots_release(task.pk, JOB, reason="bound to adopted vendor job")
    log_event("reconciled", task_id=task.pk, channel=channel.name, decision="adopt", vendor_job_id=keep.id)
    if stop_first and not keep.terminal:
        VendorJob.objects.filter(pk=record.pk, cancel_requested_at__isnull=True).update(cancel_requested_at=timezone.now())
        status = cancel_vendor_job(record, client)
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
        failure = _job_failure(keep)
        if keep.error_retryable or keep.status == "canceled":
            retry_or_fallback(task, failure, source=S.RECONCILING, new_operation=True)
        else:
            fail(task, source=S.RECONCILING, code=failure.code, message=failure.message)
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
    from tasks.services.billing import task_billing_check

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


# --- cancel -----------------------------------------------------------------------------------
def step_cancel(task_id: Any, generation: int) -> str:
    """CANCEL_REQUESTED → CANCELLED once the vendor confirms, or the job is over, or none exists."""
    return _leased(task_id, generation, S.CANCEL_REQUESTED, _cancel)


def _cancel(task: Task) -> str:
    generation = task.generation
    channel = task.channel
    open_jobs = list(VendorJob.objects.filter(task=task, terminal_at__isnull=True))
    if channel is not None and task.vendor_client_ref:
        client = VendorClient(channel, task_id=task.pk, generation=generation)
        try:
            for view in client.list_jobs(task.vendor_client_ref):
                job = _record_job(task, channel, view, adopted=True)
                if job.terminal_at is None and job not in open_jobs:
                    open_jobs.append(job)
        except VendorError:
            task_update(task.pk, state=S.CANCEL_REQUESTED, generation=generation,
                        due_at=timescale.after(RetryPolicy.for_channel(channel).delay_s(1)),
                        lease_owner="", lease_expires_at=None)
            return "cancel_retry"
    still_running = []
    for job in open_jobs:
        VendorJob.objects.filter(pk=job.pk).update(cancel_requested_at=job.cancel_requested_at or timezone.now())
        status = cancel_vendor_job(job)
        if status not in ("canceled", "completed", "failed", "gone"):
            still_running.append(job)
    if still_running:
        # The vendor cannot stop at once: keep tracking; the budget slot stays taken meanwhile.
        task_update(task.pk, state=S.CANCEL_REQUESTED, generation=generation,
                    due_at=timescale.after(PollPolicy.for_channel(channel).initial_s), lease_owner="", lease_expires_at=None)
        return "waiting_for_vendor"
    task_move(
        task.pk, source=S.CANCEL_REQUESTED, target=S.CANCELLED, generation=generation, actor=actor(),
        reason="cancel confirmed: no vendor job is running for this task",
        fields=dict(lease_owner="", lease_expires_at=None, vendor_job=task.vendor_job),
        attempt_outcome=Attempt.Outcome.CANCELLED,
    )
    return "cancelled"


def step_vendor_job_cleanup(job_pk: int) -> str:
    """Cancel (or confirm the end of) a job nobody wants any more; frees its budget slot."""
    job = VendorJob.objects.select_related("channel").filter(pk=job_pk, terminal_at__isnull=True).first()
    if job is None:
        return "done"
    if job.cancel_requested_at is None:
        return "not_requested"
    return cancel_vendor_job(job) or "unreachable"


def step_probe(channel_name: str) -> str:
    channel = VendorChannel.objects.filter(pk=channel_name).first()
    if channel is None or not breaker.is_available(channel):
        return "skipped"
    try:
        VendorClient(channel).probe()
    except VendorError as err:
        return f"probe_failed:{err.code}"
    return "probe_ok"


def new_operation_fields(task: Task, channel: VendorChannel) -> dict[str, Any]:
    """A new vendor operation on `channel`: its client_ref and key, persisted before any send."""
    seq = task.vendor_op_seq + 1
    return dict(
        channel=channel, vendor_op_seq=seq, vendor_client_ref=f"{task.pk}-{seq}",
        vendor_idempotency_key=f"sluice-{uuid.uuid4().hex}", upload_id="", upload_expires_at=None,
    )
