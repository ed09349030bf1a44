"""The start step: claim the task, upload (two-step), create the vendor job with the key that was
persisted when the task was dispatched."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks import lifecycle, timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, Task, VendorChannel, VendorJob
from tasks.observability import log_event
from tasks.rows import insert_rows, new_row, update
from tasks.scheduling.budgets import JOB, UPLOAD, slots_release, slots_released
from tasks.services.billing import several_jobs_sql, task_billing_check
from tasks.services.execution.guard import step_crashed, step_interrupted
from tasks.services.execution.jobs import (
    audit_duplicates,
    operation_of,
    orphan_check,
    record_job,
    vendor_of,
)
from tasks.services.execution.lease import Lease, actor, lease_seconds, load_task, worker_id
from tasks.services.execution.poll import SoFar, job_seen
from tasks.services.execution.retry import fail, refused, retry_or_fallback, to_reconciling
from tasks.states import State
from tasks.storage import StorageUnavailable, local_copy
from tasks.vendors import breaker
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.classification import Outcome, Row
from tasks.vendors.dialects import capabilities_for
from tasks.vendors.errors import StopUpload, VendorError
from tasks.vendors.http import SEND_BUFFER
from tasks.vendors.policies import PollPolicy
from tasks.vendors.protocol import Created, JobRequest, VendorAdapter

S = State
P = Task.Phase

ATTEMPT_OF = "t.task_id = %s AND t.generation = %s"  # the attempt of a task's generation (rows.update)


def step_start(task_id: Any, generation: int, *, task: Task | None = None) -> str:
    """Claim the task (QUEUED → RUNNING) and submit it to its channel. `task`: the task as the
    caller has just written it, not read again; RUNNING if the caller claimed it for this worker
    in the move that admitted it (dispatch.task_queue_on_arrival)."""
    if task is not None and task.state == S.RUNNING:
        return _run(task)
    task = task or load_task(task_id)
    if task is None or task.state != S.QUEUED or task.generation != generation or task.dispatched_at is None:
        return "stale"
    now = timezone.now()
    claimed, hop = claim(task, now)
    moved = lifecycle.transition(task.pk, source=S.QUEUED, target=hop.target, generation=generation, actor=hop.actor,
                                 reason=hop.reason, fields=dict(claimed, attempts=F("attempts") + 1), data=hop.data)
    if moved is None:
        return "lost_claim"
    insert_rows([claim_attempt(task, moved.generation, claimed, now)])
    # The row is now what the claim wrote (compare-and-set on the generation read above): the
    # task goes on in memory, with its channel, file and lane as loaded.
    for name, value in claimed.items():
        setattr(task, name, value)
    task.state, task.generation, task.attempts = S.RUNNING, moved.generation, task.attempts + 1
    return _run(task)


def claim(task: Task, now: datetime) -> tuple[dict[str, Any], lifecycle.Hop]:
    """What a worker's claim of a QUEUED task writes (besides one attempt more) and its history
    entry: its lease, its attempt's deadline, the phase it starts in."""
    fields = dict(
        started_at=task.started_at or now,
        phase=P.UPLOAD if uses_two_step(task.channel, capabilities_for(task.channel)) else P.CREATE,
        lease_owner=worker_id(), lease_expires_at=now + timedelta(seconds=lease_seconds()),
        attempt_deadline_at=now + timescale.delta(task.lane.execution_timeout_s), due_at=None, enqueued_at=None,
    )
    waited = round((now - (task.queued_at or task.created_at)).total_seconds(), 3)
    return fields, lifecycle.Hop(S.RUNNING, actor(), "claimed by a worker",
                                 {"channel": task.channel_id, "queue_wait_s": waited})


def claim_attempt(task: Task, generation: int, claimed: dict[str, Any], now: datetime) -> Attempt:
    """The attempt a claim made at `now` (`claimed`: its fields) starts, at the task's generation after it."""
    return new_row(Attempt, task=task, generation=generation, owner=claimed["lease_owner"], host=socket.gethostname()[:100],
                   pid=os.getpid(), lease_expires_at=claimed["lease_expires_at"], heartbeat_at=now, channel=task.channel)


def _run(task: Task) -> str:
    """Submit the claimed task under its lease; the lease goes with the step."""
    lease = Lease.adopt(task)
    started = time.monotonic()
    ended = None
    try:
        ended = submit(task, lease)
    except Exception as exc:
        step_crashed(task, exc)
        return "crashed"
    except SystemExit as stop:
        step_interrupted(task, stop, started)
        raise
    finally:
        # A task that succeeded in this step let its lease go with that move: nothing to release.
        lease.release(row=ended != "succeeded")
    return "succeeded" if ended == "succeeded" else "started"


def submit(task: Task, lease: Lease) -> str | None:
    """Upload (two-step) and create the vendor job with the key persisted at dispatch; what came
    of the job when the vendor created it finished (fetched in this step: "succeeded", ...)."""
    g = task.generation
    channel = task.channel
    vendor = vendor_of(task)
    file = task.file
    stage = "create"
    started = time.monotonic()
    uploaded = False  # its upload slot given back
    try:
        if uses_two_step(channel, vendor.capabilities):
            if not task.upload_id or _expired(task.upload_expires_at):
                stage = "upload"
                with _input_copy(file, lease) as source:
                    receipt = vendor.upload(source, size=file.size, sha256=file.sha256, operation=operation_of(task),
                                            on_chunk=lease.heartbeat)
                expires = parse_datetime(receipt.expires_at) if receipt.expires_at else None
                # Its upload slot is given back with the upload's record (in one statement on
                # PostgreSQL); a task fenced meanwhile gives it back below (StopUpload).
                if not task_update(task.pk, state=S.RUNNING, generation=g, upload_id=receipt.upload_id,
                                   upload_expires_at=expires, phase=P.CREATE,
                                   writes=(slots_released(task.pk, UPLOAD, reason="upload done"),)):
                    raise StopUpload()
                task.upload_id = receipt.upload_id
                stage = "create"
            else:
                slots_release(task.pk, UPLOAD, reason="upload done")
            uploaded = True
            request = JobRequest(kind=task.kind, target_format=task.target_format, operation=operation_of(task),
                                 options=task.params, upload_ref=task.upload_id, callback_url=vendor_callback_url(channel))
            created = vendor.create_job(request)
        else:
            with _input_copy(file, lease) as source:
                request = JobRequest(kind=task.kind, target_format=task.target_format, operation=operation_of(task),
                                     options=task.params, inline_path=source, size=file.size, sha256=file.sha256,
                                     on_chunk=lease.heartbeat, callback_url=vendor_callback_url(channel))
                created = vendor.create_job(request)
    except StopUpload:
        slots_release(task.pk, UPLOAD, reason="upload stopped")
        lease.release()
        log_event("upload_stopped", task_id=task.pk, generation=g, reason="fenced or cancel requested")
        return None
    except VendorError as err:
        hold = upload_drain_s(channel) if err.bytes_sent and err.outcome == Outcome.AMBIGUOUS else 0.0
        slots_release(task.pk, UPLOAD, reason="upload ended", hold_s=hold)
        _attempt_noted(task, g, {"upload_ms": int((time.monotonic() - started) * 1000)})
        _submit_failed(task, err, stage=stage)
        return None
    if not uploaded:
        slots_release(task.pk, UPLOAD, reason="upload done")
    attempt = {"upload_ms": int((time.monotonic() - started) * 1000), "vendor_job_id": created.job.id}
    # A vendor that answers the create with the job already finished (a fast engine, a replayed
    # key) is not polled for what it just said: the result is fetched in this step, under its lease.
    finished = created.job.terminal
    if not finished:
        _attempt_noted(task, g, attempt)
    # When it finished, the attempt's upload time and job are written with its end if the task
    # succeeds in this step, else once the step is done with it (whatever became of it).
    try:
        ended = _created(task, lease, vendor, created, finished=finished, attempt=attempt)
    except BaseException as exc:
        if finished:
            _attempt_noted(task, g, attempt, during=exc)
        raise
    if finished and ended != "succeeded":
        _attempt_noted(task, g, attempt)
    return ended


def _created(task: Task, lease: Lease, vendor: VendorAdapter, created: Created, *, finished: bool,
             attempt: dict[str, Any]) -> str | None:
    """Record the job the vendor created and audit its operation; a job it created `finished`
    is seen (fetched, or its failure handled) in this step, and what came of it is returned."""
    completed = created.job.status == "completed"
    # Its completion is said in the creation's history entry, unless the vendor says it processed
    # another input than ours (the integrity failure is what is recorded then).
    said = completed and created.job.input_sha256 in ("", None, task.file.sha256)
    job = _job_created(task, created, keep_lease=finished, completed=completed, said=said)
    audited = False
    if task.channel.audit_after_create:
        # A vendor that ignores keys or double-creates is caught while the extras can be stopped.
        audited = audit_duplicates(task, task.channel, vendor, keep_job_id=created.job.id) is not None
    if not finished or job is None:
        return None
    lease.heartbeat()  # renewed before the download, as between upload chunks
    return job_seen(task, job, created.job, so_far=SoFar(said=said, audited=audited, attempt=attempt))


def _attempt_noted(task: Task, generation: int, fields: dict[str, Any], *, during: BaseException | None = None) -> None:
    """What the task's attempt at `generation` learnt (its upload's time, its vendor job).
    `during`: written while that exception ends the step; failing then, it is only logged (the
    step's own exception, not this one, says what happened)."""
    try:
        update(Attempt, fields, ATTEMPT_OF, [("task", task.pk), ("generation", generation)])
    except Exception as exc:
        if during is None:
            raise
        log_event("attempt_not_noted", logging.WARNING, task_id=task.pk, generation=generation,
                  error_class=type(exc).__name__)


def uses_two_step(channel: VendorChannel, capabilities: Capabilities) -> bool:
    """Upload first, then create: the channel's mode, unless its vendor only knows this one."""
    return channel.mode == VendorChannel.Mode.TWO_STEP or "inline" not in capabilities.upload_modes


def vendor_callback_url(channel: VendorChannel) -> str | None:
    """Signed vendor callbacks, when this installation is reachable and the channel has a secret."""
    if not settings.PUBLIC_URL or not channel.webhook_secret:
        return None
    return f"{settings.PUBLIC_URL.rstrip('/')}/api/v1/vendor-callbacks/{channel.name}"


def upload_drain_s(channel: VendorChannel) -> float:
    """How long an abandoned upload may keep the vendor busy: what our socket buffers still held
    (the client's send buffer, see http.SEND_BUFFER) at the channel's bandwidth estimate."""
    return timescale.seconds(4 * SEND_BUFFER / max(channel.upload_bandwidth_bytes_s, 1.0))


def _expired(moment: datetime | None) -> bool:
    return moment is not None and moment <= timezone.now() + timescale.delta(60)


def _job_created(task: Task, created: Created, *, keep_lease: bool = False, completed: bool = False,
                 said: bool = False) -> VendorJob | None:
    """Record the created job and make the task poll it (or, `completed`, fetch its result); the
    job, or None if the task was fenced meanwhile. With `keep_lease` this step goes on with the
    job (its lease stays; the due poll or fetch is the way back if the step dies); with `said`
    the job's history entry also says the vendor completed it."""
    g = task.generation
    channel = task.channel
    job = record_job(task, channel, created.job, adopted=False, billing_check=False)
    breaker.refund_retry_token(channel)
    poll = PollPolicy.for_channel(channel)
    first = poll.next_interval_s(0)
    now = timezone.now()
    lease_fields = {} if keep_lease else dict(lease_owner="", lease_expires_at=None)
    phase = P.FETCH if completed else P.POLL
    entry = dict(reason="vendor job replayed by idempotency key" if created.replayed else "vendor job created",
                 data={"vendor_job_id": created.job.id, "channel": channel.name})
    if said:  # the create's answer says it finished: one entry for both (the task's stages read it)
        entry["reason"] += "; the vendor completed the job"
        entry["data"]["vendor_status"] = "completed"
    # The job holds the task's job slot from now on: the slot is given back with the job's binding
    # (in its statement on PostgreSQL), whether or not the task was fenced meanwhile.
    released = slots_released(task.pk, JOB, reason="bound to vendor job", if_moved=False)
    updated = lifecycle.task_update_recorded(
        task.pk, state=S.RUNNING, generation=g, actor=actor(), **entry, returning=(several_jobs_sql(),),
        writes=(released,),
        vendor_job=job, phase=phase, poll_interval_s=first, outage_since=None,
        due_at=now + timescale.delta(poll.jittered(first)), poll_deadline_at=now + timescale.delta(poll.budget_s),
        error_code="", error_message="", fetch_attempts=0, **lease_fields,
    )
    task.vendor_job, task.phase, task.fetch_attempts = job, phase, 0
    if updated is None or updated.said is None or updated.said[0]:
        # The job is billed: a second job of this task is reported at once (record_job's check,
        # run here once the task names the job it keeps, and only when there is a second).
        task_billing_check(task.pk)
    if not updated:
        # Fenced while creating: the job is recorded (and said so); whoever moved the task decides its fate.
        lifecycle.record_event(task.pk, generation=g, actor=actor(), **entry)
        orphan_check(job)
        return None
    return job


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
        refused(task, source=S.RUNNING, code=err.code, message=err.message, data={"error_class": err.error_class})


def new_operation_fields(task: Task, channel: VendorChannel) -> dict[str, Any]:
    """A new vendor operation on `channel`: its client_ref and key, persisted before any send."""
    seq = task.vendor_op_seq + 1
    return dict(
        channel=channel, vendor_op_seq=seq, vendor_client_ref=f"{task.pk}-{seq}",
        vendor_idempotency_key=f"sluice-{uuid.uuid4().hex}", upload_id="", upload_expires_at=None,
    )


@contextlib.contextmanager
def _input_copy(file, lease: Lease):
    """The task's file on this host's disk while the vendor gets it; the lease is renewed while a
    copy comes from a bucket, and a store that does not give it is a failure before any vendor
    call (not processed: retried)."""
    try:
        with local_copy(file.storage_name, on_progress=lease.heartbeat) as source:
            yield source
    except StorageUnavailable as exc:
        raise VendorError(Row(Outcome.NOT_PROCESSED, True, "the object store did not give the file"),
                          operation="upload", code="storage_unavailable", detail=str(exc)[:200]) from None
