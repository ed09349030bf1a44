"""Vendor jobs as Sluice records them: every job a task was billed for, duplicates, cancels of jobs
nobody wants any more, breaker probes."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from tasks import lifecycle, timescale
from tasks.models import Task, VendorChannel, VendorJob
from tasks.observability import log_event
from tasks.rows import insert_rows
from tasks.scheduling.budgets import vendor_job_terminal
from tasks.services.billing import task_billing_check
from tasks.states import TERMINAL_STATES, State
from tasks.vendors import breaker
from tasks.vendors.classification import Failure, Outcome
from tasks.vendors.dialects import adapter_for, capabilities_for
from tasks.vendors.errors import VendorError
from tasks.vendors.protocol import JobView, Operation, VendorAdapter

S = State
P = Task.Phase


# A job that answers 404 this soon after we created it is "not visible yet", not gone.
TRANSIENT_404_WINDOW_S = 30.0
# A duplicate audit that could not list the operation's jobs is tried again after these delays
# (nominal); after the last, the vendors' ledger sync is the check that remains.
AUDIT_RETRY_S = (30.0, 120.0, 600.0, 1800.0, 3600.0)
# An ambiguous create (its answer lost) may still be run by the vendor after our timeout, after the
# resend and even after the result: the operation is audited again this long after it, once the
# task has ended.
AUDIT_FOLLOW_UP_S = 120.0


def audit_retry_delay_s(failures: int) -> float | None:
    """When an audit that failed `failures` times in a row is tried again; None: no more."""
    return AUDIT_RETRY_S[failures - 1] if 1 <= failures <= len(AUDIT_RETRY_S) else None


def operation_of(task: Task) -> Operation:
    """The task's current vendor operation, as an adapter finds it again."""
    return Operation(client_ref=task.vendor_client_ref, idempotency_key=task.vendor_idempotency_key,
                     upload_ref=task.upload_id)


def vendor_of(task: Task) -> VendorAdapter:
    """The task's channel, for this step: a running attempt's calls end by its execution deadline,
    any other step's by the business deadline."""
    deadline = task.attempt_deadline_at if task.state == S.RUNNING else task.deadline_at
    return adapter_for(task.channel, task_id=task.pk, generation=task.generation, deadline=deadline)


def record_job(task: Task, channel: VendorChannel, view: JobView, *, adopted: bool, duplicate_of: VendorJob | None = None,
               billing_check: bool = True) -> VendorJob:
    """A job exists at the vendor: record it whatever happens to the task (it holds budget, and it
    was billed: a second job of the same task is reported at once). `billing_check=False`: the
    caller runs task_billing_check itself right after its next write (which says whether the task
    has a second job to check); should it die before, the task's terminal move checks."""
    fields = dict(
        task=task, client_ref=view.client_ref or task.vendor_client_ref, idempotency_key=task.vendor_idempotency_key,
        status=view.status, adopted=adopted, duplicate_of=duplicate_of, billing_units=view.billing_units,
        billing_unit=view.billing_unit or "", amount_cents=view.amount_cents, input_sha256=view.input_sha256,
        result_sha256=view.result_sha256 or "", result_size=view.result_size, engine_version=view.engine_version[:64],
        terminal_at=timezone.now() if view.terminal else None,
    )
    if adopted:  # found at the vendor: often recorded already
        job, created = VendorJob.objects.get_or_create(channel=channel, vendor_job_id=view.id, defaults=fields)
    else:  # just created: new but for a replayed key, so written first and read only if it was known
        try:
            # A savepoint only inside a caller's transaction: alone, the failed INSERT of a
            # replayed job leaves nothing to roll back (and no BEGIN/COMMIT is paid for it).
            with transaction.atomic() if connection.in_atomic_block else contextlib.nullcontext():
                job, created = VendorJob(channel=channel, vendor_job_id=view.id, **fields), True
                insert_rows([job])
        except IntegrityError:
            job, created = VendorJob.objects.get(channel=channel, vendor_job_id=view.id), False
    if view.terminal and not created:
        vendor_job_terminal(job, view.status)
    if created and billing_check:
        task_billing_check(task.pk)
    return job


def job_failure(view: JobView) -> Failure:
    outcome = Outcome.NOT_PROCESSED if view.error_retryable or view.status == "canceled" else Outcome.REFUSED
    return Failure(outcome, code=f"vendor_{view.error_code or view.status}"[:64],
                   message=view.error_message or f"the vendor job ended {view.status}", error_class="VendorJobFailed")


def audit_duplicates(task: Task, channel: VendorChannel, vendor: VendorAdapter, *, keep_job_id: str) -> int | None:
    """List the operation's jobs: more than one means the vendor ignored our key (or has none, or
    double-created). The extras are recorded, reported and stopped. Returns how many there were;
    None when the vendor could not be asked, and then the audit is due again later."""
    if not task.vendor_client_ref or not vendor.capabilities.can_reconcile:
        return 0
    try:
        jobs = vendor.find_jobs(operation_of(task))
    except VendorError as err:
        _audit_failed(task, err.code or "vendor_error")
        return None
    if task.billing_audit_attempts:  # the failures in a row are over
        Task.objects.filter(pk=task.pk).update(billing_audit_attempts=0)
    extras = [j for j in jobs if j.id != keep_job_id]
    if not extras:
        return 0
    keep = VendorJob.objects.filter(channel=channel, vendor_job_id=keep_job_id).first()
    for view in extras:
        record = record_job(task, channel, view, adopted=True, duplicate_of=keep)
        VendorJob.objects.filter(pk=record.pk).update(duplicate_of=keep)
        if not view.terminal:
            VendorJob.objects.filter(pk=record.pk).update(cancel_requested_at=timezone.now())
            cancel_vendor_job(record, vendor)
    task_billing_check(task.pk)
    return len(extras)


def audit_again(task_id: Any, *, after_s: float) -> None:
    """Have the operation audited again in `after_s` (nominal) or later: one pending audit serves
    every reason, so it is never moved earlier than one already due."""
    due = timezone.now() + timedelta(seconds=timescale.seconds(after_s))
    Task.objects.filter(pk=task_id).exclude(billing_audit_due_at__gt=due).update(billing_audit_due_at=due)


def _audit_failed(task: Task, code: str) -> None:
    failures = (Task.objects.filter(pk=task.pk).values_list("billing_audit_attempts", flat=True).first() or 0) + 1
    delay = audit_retry_delay_s(failures)
    Task.objects.filter(pk=task.pk).update(billing_audit_attempts=failures)
    if delay is not None:
        audit_again(task.pk, after_s=delay)
        log_event("duplicate_audit_failed", task_id=task.pk, channel=task.channel_id, attempt=failures,
                  decision=f"again_in_{int(delay)}s", reason=code)
        return
    Task.objects.filter(pk=task.pk).update(billing_audit_due_at=None, billing_audit_attempts=0)
    lifecycle.record_event(task.pk, generation=task.generation, actor="billing",
                           reason=f"the vendor could not list this operation's jobs after {failures} audits "
                                  f"({code}); a duplicate can now show only in a usage ledger"
                                  + ("" if task.channel and capabilities_for(task.channel).billing_ledger
                                     else ", and this vendor publishes none"),
                           data={"client_ref": task.vendor_client_ref})


def step_billing_audit(task_id: Any) -> str:
    """A due audit of the task's operation: once the task has ended, every job the vendor holds
    for it beyond the one kept is recorded, reported and stopped."""
    task = Task.objects.select_related("channel", "vendor_job").filter(pk=task_id).first()
    if task is None or task.billing_audit_due_at is None:
        return "not_due"
    if task.state not in TERMINAL_STATES:
        audit_again(task.pk, after_s=AUDIT_FOLLOW_UP_S)  # the end's own audit runs first
        return "waiting"
    if task.channel is None or not task.vendor_client_ref:
        Task.objects.filter(pk=task.pk).update(billing_audit_due_at=None, billing_audit_attempts=0)
        return "nothing_to_audit"
    keep = task.vendor_job.vendor_job_id if task.vendor_job and task.vendor_job.channel_id == task.channel_id else ""
    # The task has ended: its calls are bounded by their own timeouts, not a deadline now past.
    try:
        found = audit_duplicates(task, task.channel, adapter_for(task.channel, task_id=task.pk), keep_job_id=keep)
    except Exception as exc:  # whatever broke, the audit is tried again on its schedule, not for ever
        _audit_failed(task, type(exc).__name__)
        raise
    if found is None:
        return "unreachable"
    Task.objects.filter(pk=task.pk).update(billing_audit_due_at=None, billing_audit_attempts=0)
    log_event("duplicate_audit", task_id=task.pk, channel=task.channel_id, count=found, decision="audited")
    return f"audited:{found}"


def cancel_vendor_job(job: VendorJob, vendor: VendorAdapter | None = None) -> str | None:
    """Ask the vendor to stop a job; returns the status it reports (None if unreachable).

    A vendor that cannot stop a job (capabilities.cancel false) is asked how it is: a finished job
    is then dropped (its data deleted where the vendor allows it), a running one is left to end."""
    vendor = vendor or adapter_for(job.channel, task_id=job.task_id)
    try:
        if vendor.capabilities.cancel:
            view = vendor.cancel_job(job.vendor_job_id)
        else:
            view = vendor.get_job(job.vendor_job_id)
            if view.terminal:
                _drop_finished(vendor, job)
    except VendorError as err:
        if err.code == "already_finished" or err.status == 409:
            try:
                view = vendor.get_job(job.vendor_job_id)
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


def _drop_finished(vendor: VendorAdapter, job: VendorJob) -> None:
    """A finished job nobody wants: its data is deleted at the vendor (best effort)."""
    try:
        vendor.cancel_job(job.vendor_job_id)
    except VendorError:
        pass


def orphan_check(job: VendorJob) -> None:
    """A job whose task no longer wants it (finished, cancelled) is cancelled at the vendor."""
    task = Task.objects.filter(pk=job.task_id).values("state", "vendor_job_id").first()
    if task and task["state"] in (S.SUCCEEDED, S.FAILED, S.CANCELLED, S.EXPIRED) and task["vendor_job_id"] != job.pk:
        VendorJob.objects.filter(pk=job.pk, terminal_at__isnull=True).update(cancel_requested_at=timezone.now())


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
        adapter_for(channel).probe()
    except VendorError as err:
        return f"probe_failed:{err.code}"
    return "probe_ok"
