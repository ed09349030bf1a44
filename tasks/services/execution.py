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
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks import lifecycle, timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, DuplicateIncident, Task, VendorChannel, VendorJob
from tasks.observability import log_event
from tasks.scheduling.budgets import JOB, UPLOAD, slots_release, vendor_job_terminal
from tasks.services.outcomes import task_move
from tasks.states import State
from tasks.storage import attempt_result_path, relative_result
from tasks.vendor import breaker
from tasks.vendor.classification import Outcome
from tasks.vendor.client import Created, JobView, VendorClient
from tasks.vendor.errors import StopUpload, VendorError
from tasks.vendor.policies import PollPolicy, RetryPolicy

S = State
P = Task.Phase
# A job that answers 404 this soon after we created it is "not visible yet", not gone.
TRANSIENT_404_WINDOW_S = 30.0


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
    """A job exists at the vendor: record it whatever happens to the task (it holds budget)."""
    job, _ = VendorJob.objects.get_or_create(
        channel=channel, vendor_job_id=view.id,
        defaults=dict(
            task=task, client_ref=view.client_ref or task.vendor_client_ref, idempotency_key=task.vendor_idempotency_key,
            status=view.status, adopted=adopted, duplicate_of=duplicate_of, billing_units=view.billing_units,
            billing_unit=view.billing_unit or "", amount_cents=view.amount_cents, input_sha256=view.input_sha256,
        ),
    )
    if view.terminal:
        vendor_job_terminal(job, view.status)
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
        task.pk, state=S.RUNNING, generation=g, vendor_job=job, phase=P.POLL, poll_interval_s=first,
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
    outcome = err.outcome
    if stage == "upload" and outcome == Outcome.AMBIGUOUS:
        # Uploads are never billed: a broken upload is simply sent again.
        outcome = Outcome.NOT_PROCESSED
    if err.code == "upload_not_found":
        task_update(task.pk, state=S.RUNNING, generation=task.generation, upload_id="", upload_expires_at=None)
    if outcome == Outcome.NOT_PROCESSED:
        retry_or_fallback(task, err, source=S.RUNNING)
    elif outcome == Outcome.AMBIGUOUS and settings.UNSAFE_SKIP_RECONCILIATION:
        retry_or_fallback(task, err, source=S.RUNNING, new_operation=True)
    elif outcome == Outcome.AMBIGUOUS:
        to_reconciling(task, err)
    elif outcome == Outcome.ALARM:
        log_event("idempotency_alarm", logging.ERROR, task_id=task.pk, channel=task.channel_id, code=err.code)
        fail(task, source=S.RUNNING, code=err.code, message=f"{err.message}: our bug or the vendor's; investigate",
             data={"alarm": True, "error_class": err.error_class})
    else:
        fail(task, source=S.RUNNING, code=err.code, message=err.message, data={"error_class": err.error_class})
        from tasks.services.quarantine import poison_check

        poison_check(task=task)


def to_reconciling(task: Task, err: VendorError) -> None:
    task_move(
        task.pk, source=S.RUNNING, target=S.RECONCILING, generation=task.generation, actor=actor(),
        reason=f"{err.error_class or err.status} during {err.operation}: the vendor may have acted; reconcile before any retry",
        fields=dict(due_at=timezone.now(), enqueued_at=None, phase="", lease_owner="", lease_expires_at=None,
                    error_code=err.code, error_message=err.message[:500]),
        attempt_outcome=Attempt.Outcome.RECONCILE, data={"error_class": err.error_class},
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


def retry_or_fallback(task: Task, err: VendorError, *, source: State, new_operation: bool = False) -> None:
    """A provably not-processed failure (or a finished failed job): wait durably, maybe elsewhere."""
    channel = task.channel
    policy = RetryPolicy.for_channel(channel)
    now = timezone.now()
    fields: dict[str, Any] = dict(
        error_code=err.code[:64], error_message=err.message[:500], error_retryable=True, phase="",
        lease_owner="", lease_expires_at=None, dispatched_at=None, enqueued_at=None,
        last_retry_after_s=err.retry_after_s, vendor_job=None,
    )
    if new_operation:
        # The old job is over: the next submission is a new operation with a new key.
        fields.update(vendor_client_ref="", vendor_idempotency_key="", upload_id="", upload_expires_at=None)
    breaker_denied = err.error_class == "BreakerOpen"
    flow_control = err.row.flow_control
    attempts_here = task.channel_attempts + (0 if flow_control else 1)
    spent = not flow_control and policy.exhausted(attempts_here)
    dry = not flow_control and not spent and not breaker.take_retry_token(channel, timeout=err.is_timeout)
    fallbacks = other_channels(task, excluding=[channel.name, *task.abandoned_channels])
    if breaker_denied and fallbacks:
        fields.update(_abandon(task, channel))
        delay_real = timescale.seconds(policy.base_s) * 0.1
        decision = f"breaker open: fall back from {channel.name}"
    elif breaker_denied:
        delay_real = max(breaker.retry_in_s(channel) or 0.0, timescale.seconds(policy.base_s)) * 1.1
        decision = "breaker open: wait for it"
    elif spent and fallbacks:
        fields.update(_abandon(task, channel))
        delay_real = timescale.seconds(policy.delay_s(0))
        decision = f"retries on {channel.name} spent: fall back"
    elif spent:
        fail(task, source=source, code="retries_exhausted",
             message=f"{err.message}; retries on every channel are spent", retryable=True, dead_letter=True,
             data={"error_class": err.error_class or "retryable"})
        return
    elif dry:
        # The channel's retry budget is dry: slow down rather than multiply an outage's traffic.
        delay_real = timescale.seconds(policy.cap_s) * random.uniform(0.5, 1.0)
        decision = f"retry budget of {channel.name} is dry: wait {timescale.nominal(delay_real):.1f}s"
    else:
        delay_real = timescale.seconds(policy.delay_s(task.channel_attempts, err.retry_after_s))
        fields.update(channel_attempts=attempts_here)
        decision = f"retry on {channel.name} in {timescale.nominal(delay_real):.1f}s"
    due = now + timedelta(seconds=delay_real)
    if due >= task.deadline_at:
        fail(task, source=source, code="deadline_exceeded",
             message=f"the business deadline passes before the next try ({err.message})", retryable=True,
             dead_letter=True, data={"error_class": err.error_class or "retryable"})
        return
    fields.update(due_at=due, retries=F("retries") + 1)
    task_move(
        task.pk, source=source, target=S.RETRY_WAIT, generation=task.generation, actor=actor(),
        reason=f"{err.code}: {decision}", fields=fields, attempt_outcome=Attempt.Outcome.RETRY,
        data={"error_class": err.error_class, "retry_after_s": err.retry_after_s, "delay_s": round(delay_real, 3)},
    )
    slots_release(task.pk, JOB, UPLOAD, reason="not processed: retry later")
    log_event("retry_scheduled", task_id=task.pk, channel=channel.name, code=err.code, delay_s=round(delay_real, 3),
              retry_after_s=err.retry_after_s, decision=decision)


def _abandon(task: Task, channel: VendorChannel) -> dict[str, Any]:
    return dict(
        abandoned_channels=[*task.abandoned_channels, channel.name], channel=None, channel_attempts=0,
        vendor_client_ref="", vendor_idempotency_key="", upload_id="", upload_expires_at=None,
    )


# --- poll -------------------------------------------------------------------------------------
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
    finally:
        lease.release()


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
            to_reconciling(task, err)
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
        return fetch_and_commit(task, job, view, client)
    if view.status == "failed":
        err = _job_error(view)
        if view.error_retryable:
            retry_or_fallback(task, err, source=S.RUNNING, new_operation=True)
        else:
            fail(task, source=S.RUNNING, code=err.code, message=err.message)
            from tasks.services.quarantine import poison_check

            poison_check(task=task)
        return "failed"
    retry_or_fallback(task, _job_error(view), source=S.RUNNING, new_operation=True)
    return "canceled_at_vendor"


def _job_error(view: JobView) -> VendorError:
    from tasks.vendor.classification import Row

    outcome = Outcome.NOT_PROCESSED if view.error_retryable or view.status == "canceled" else Outcome.REFUSED
    code = f"vendor_{view.error_code or view.status}"[:64]
    message = view.error_message or f"the vendor job ended {view.status}"
    return VendorError(Row(outcome, False, message), operation="get_job", code=code, error_class="VendorJobFailed")


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
    """The vendor took longer than the poll budget: stop paying for it and try again."""
    job = task.vendor_job
    VendorJob.objects.filter(pk=job.pk, terminal_at__isnull=True).update(cancel_requested_at=timezone.now())
    from tasks.vendor.classification import Row

    err = VendorError(Row(Outcome.NOT_PROCESSED, False, "the vendor did not finish within the poll budget"),
                      operation="get_job", code="poll_budget_exhausted", error_class="PollBudget")
    retry_or_fallback(task, err, source=S.RUNNING, new_operation=True)


def fetch_and_commit(task: Task, job: VendorJob, view: JobView, client: VendorClient) -> str:
    g = task.generation
    if view.input_sha256 and view.input_sha256 != task.file.sha256:
        VendorJob.objects.filter(pk=job.pk).update(integrity_flag="input_digest_mismatch")
        return _integrity_failure(task, "the vendor processed a different input than ours (sha256 mismatch)")
    task_update(task.pk, state=S.RUNNING, generation=g, phase=P.FETCH)
    dest = attempt_result_path(task.pk, g)
    try:
        fetched = client.fetch_result(job.vendor_job_id, dest)
    except VendorError as err:
        dest.unlink(missing_ok=True)
        if err.outcome in (Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS):
            task_update(task.pk, state=S.RUNNING, generation=g, phase=P.POLL)
            _schedule_poll(task, retry_after_s=err.retry_after_s)
            return "fetch_retry"
        fail(task, source=S.RUNNING, code=err.code, message=err.message)
        return "fetch_failed"
    expected = [d for d in (view.result_sha256, fetched.declared_sha256) if d]
    if any(d.lower() != fetched.sha256 for d in expected):
        dest.unlink(missing_ok=True)
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
    return "succeeded"


def _integrity_failure(task: Task, message: str) -> str:
    from tasks.vendor.classification import Row

    err = VendorError(Row(Outcome.NOT_PROCESSED, False, message), operation="get_result", code="integrity_error",
                      error_class="IntegrityError")
    retry_or_fallback(task, err, source=S.RUNNING, new_operation=True)
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
    amount = 0
    for view in extras:
        record = _record_job(task, channel, view, adopted=True, duplicate_of=keep)
        VendorJob.objects.filter(pk=record.pk).update(duplicate_of=keep)
        amount += view.amount_cents or 0
        if not view.terminal:
            VendorJob.objects.filter(pk=record.pk).update(cancel_requested_at=timezone.now())
            cancel_vendor_job(record, client)
    incident, created = DuplicateIncident.objects.get_or_create(
        task=task, channel=channel, client_ref=client_ref,
        defaults=dict(kept_job_id=keep_job_id, duplicate_job_ids=[j.id for j in extras], duplicate_amount_cents=amount),
    )
    if created:
        lifecycle.record_event(
            task.pk, generation=task.generation, actor=actor(),
            reason=f"duplicate billing: the vendor holds {len(jobs)} jobs for one operation; kept {keep_job_id}, cancelled the rest",
            data={"kept": keep_job_id, "duplicates": [j.id for j in extras], "amount_cents": amount},
        )
        log_event("duplicate_billing", logging.WARNING, task_id=task.pk, channel=channel.name, count=len(extras))
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
def step_reconcile(task_id: Any, generation: int) -> str:
    return _leased(task_id, generation, S.RECONCILING, _reconcile)


def _reconcile(task: Task) -> str:
    generation = task.generation
    channel = task.channel
    timed_out = task.error_code == "execution_timeout"
    if channel is None or not task.vendor_client_ref:
        return _reconciled_none(task, "no vendor operation was started")
    client = VendorClient(channel, task_id=task.pk, generation=generation)
    try:
        jobs = client.list_jobs(task.vendor_client_ref)
        known = task.vendor_job
        if known and all(j.id != known.vendor_job_id for j in jobs):
            jobs.append(client.get_job(known.vendor_job_id))
    except VendorError as err:
        delay = max(err.retry_after_s or 0, RetryPolicy.for_channel(channel).delay_s(1))
        if err.error_class == "BreakerOpen":
            delay = max(delay, timescale.nominal(breaker.retry_in_s(channel) or 0))
        task_update(task.pk, state=S.RECONCILING, generation=generation, due_at=timescale.after(delay),
                    lease_owner="", lease_expires_at=None)
        return "reconcile_retry"
    from tasks.observability import log_event as _log

    live = [j for j in jobs if j.status != "canceled" and j.status != "failed"]
    if not jobs:
        _log("reconciled", task_id=task.pk, channel=channel.name, decision="none_found")
        return _reconciled_none(task, "the vendor holds no job for this operation")
    keep = _choose_job(live or jobs, task)
    for view in jobs:
        _record_job(task, channel, view, adopted=True)
    if len(jobs) > 1:
        audit_duplicates(task, channel, client, keep_job_id=keep.id)
    record = VendorJob.objects.get(channel=channel, vendor_job_id=keep.id)
    slots_release(task.pk, JOB, reason="bound to adopted vendor job")
    _log("reconciled", task_id=task.pk, channel=channel.name, decision="adopt", vendor_job_id=keep.id)
    if timed_out and not keep.terminal:
        VendorJob.objects.filter(pk=record.pk, cancel_requested_at__isnull=True).update(cancel_requested_at=timezone.now())
        status = cancel_vendor_job(record, client)
        if status not in VendorJob.TERMINAL and status != "gone":
            # Not stopped yet: a new execution starts only once this one is confirmed ended.
            task_update(task.pk, state=S.RECONCILING, generation=generation, lease_owner="", lease_expires_at=None,
                        due_at=timescale.after(PollPolicy.for_channel(channel).initial_s))
            return "waiting_for_cancel"
        from tasks.vendor.classification import Row

        err = VendorError(Row(Outcome.NOT_PROCESSED, False, "the attempt exceeded its execution timeout"),
                          operation="reconcile", code="execution_timeout", error_class="ExecutionTimeout")
        retry_or_fallback(task, err, source=S.RECONCILING, new_operation=True)
        return "timed_out"
    if keep.status in ("failed", "canceled"):
        vendor_job_terminal(record, keep.status)
        err = _job_error(keep)
        if keep.error_retryable or keep.status == "canceled":
            retry_or_fallback(task, err, source=S.RECONCILING, new_operation=True)
        else:
            fail(task, source=S.RECONCILING, code=err.code, message=err.message)
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
                    lease_owner="", lease_expires_at=None, attempts=F("attempts") + 1),
        data={"vendor_job_id": keep.id, "jobs_found": len(jobs)},
    )
    if moved:
        Attempt.objects.create(task=task, generation=moved.generation, owner=worker_id(), host=socket.gethostname()[:100],
                               pid=os.getpid(), channel=channel, vendor_job_id=keep.id, note="adopted after reconciliation")
    return "adopted"


def _choose_job(jobs: list[JobView], task: Task) -> JobView:
    # Prefer the job we already know, then the oldest (the one our first request created).
    if task.vendor_job and any(j.id == task.vendor_job.vendor_job_id for j in jobs):
        return next(j for j in jobs if j.id == task.vendor_job.vendor_job_id)
    return sorted(jobs, key=lambda j: (j.created_at, j.id))[0]


def _reconciled_none(task: Task, why: str) -> str:
    from tasks.vendor.classification import Row

    slots_release(task.pk, JOB, UPLOAD, reason="reconciled: no vendor job")
    err = VendorError(Row(Outcome.NOT_PROCESSED, False, why), operation="reconcile",
                      code=task.error_code or "reconciled_none", error_class="Reconciled")
    if task.error_code == "execution_timeout":
        retry_or_fallback(task, err, source=S.RECONCILING, new_operation=True)
    else:
        # Resubmit with the same key: the vendor provably holds nothing for it.
        retry_or_fallback(task, err, source=S.RECONCILING)
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
