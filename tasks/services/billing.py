"""Billing, accounted per task: every vendor job a task was billed for, across channels, attempts
and client_refs; and reconciliation with each vendor's usage ledger.

A task billed for more than one job is a billing incident whatever the reason (a vendor that
ignored our key, a job the vendor lost, a retry after a failed or unusable job), shown with the
amounts and the cause of each extra job. The live check runs whenever Sluice records a job; the
ledger check catches what the task alone cannot see: a job billed under an operation whose answer
never came back, a duplicate that appeared after the task finished.
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections, router, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks import lifecycle, timescale
from tasks.models import (
    ChannelHealth,
    DuplicateIncident,
    LedgerEntry,
    Task,
    VendorChannel,
    VendorJob,
)
from tasks.observability import log_event
from tasks.rows import select
from tasks.vendors.breaker import health_for
from tasks.vendors.classification import Outcome
from tasks.vendors.dialects import adapter_for, capabilities_for
from tasks.vendors.errors import VendorError
from tasks.vendors.policies import RetryPolicy
from tasks.vendors.protocol import BillingEntry, BillingPage, VendorAdapter

# A ledger sync retries a page this many times, waiting at most this long in all (nominal).
LEDGER_TRIES_PER_PAGE = 4
LEDGER_BUDGET_S = 30.0
# An incomplete sync tries again after this long (nominal, jittered).
LEDGER_RETRY_S = 60.0


# --- per task -------------------------------------------------------------------------------------
def job_cause(job: VendorJob) -> str:
    """Why this extra job of a task exists, in words an operator can act on."""
    if job.duplicate_of_id is not None:
        return "a duplicate of the same operation: the vendor ignored our key or created two jobs"
    if job.status == "lost":
        return "billed, then lost by the vendor (it forgot the job); the operation was sent again"
    if job.integrity_flag:
        return f"billed, but its result was unusable ({job.integrity_flag}); retried as a new operation"
    if job.status == "failed":
        return "billed, then failed at the vendor; retried as a new operation"
    if job.status == "canceled":
        return "billed, then stopped by Sluice (poll budget or execution timeout); retried"
    if job.status == "unknown":
        return f"billed by the vendor under {job.client_ref or 'an operation of this task'}; Sluice never saw the job (a lost answer)"
    return "another operation of the same task"


def several_jobs_sql() -> str:
    """Whether a task has more than one vendor job (1 or 0), as SQL over its row written `{row}`
    (`lifecycle`'s `returning`), for the database its moves are written to: a move that asks this
    in its own statement runs task_billing_check only when the check has something to find."""
    quote = connections[router.db_for_write(Task)].ops.quote_name
    job = VendorJob._meta.get_field("task")
    return (f"CASE WHEN (SELECT COUNT(*) FROM {quote(VendorJob._meta.db_table)} j "
            f"WHERE j.{quote(job.column)} = {{row}}.{quote(Task._meta.pk.column)}) > 1 THEN 1 ELSE 0 END")


def task_billing_check(task_id: Any) -> DuplicateIncident | None:
    """Every billed job of the task beyond the one it keeps is recorded in its one incident."""
    jobs = select(VendorJob, "t.task_id = %s ORDER BY t.created_at, t.id", [("task", task_id)])  # every step's end reads them
    if len(jobs) < 2:
        return None
    current = Task.objects.filter(pk=task_id).values_list("vendor_job_id", "generation").first()
    if current is None:
        return None
    kept = next((j for j in jobs if j.pk == current[0]), None) or next(
        (j for j in reversed(jobs) if j.status == "completed" and j.duplicate_of_id is None), jobs[0]
    )
    extras = [j for j in jobs if j.pk != kept.pk]
    rows = [
        {"channel": j.channel_id, "job_id": j.vendor_job_id, "client_ref": j.client_ref,
         "amount_cents": j.amount_cents or 0, "status": j.status, "cause": job_cause(j)}
        for j in extras
    ]
    with transaction.atomic():
        incident, created = DuplicateIncident.objects.select_for_update().get_or_create(
            task_id=task_id,
            defaults=dict(channel_id=kept.channel_id, client_ref=kept.client_ref, kept_job_id=kept.vendor_job_id),
        )
        before = set(incident.duplicate_job_ids)
        incident.channel_id, incident.client_ref, incident.kept_job_id = kept.channel_id, kept.client_ref, kept.vendor_job_id
        incident.duplicate_job_ids = [r["job_id"] for r in rows]
        incident.duplicate_amount_cents = sum(r["amount_cents"] for r in rows)
        incident.jobs = rows
        incident.save()
    new = set(incident.duplicate_job_ids) - before
    if new:
        lifecycle.record_event(
            task_id, generation=current[1], actor="billing",
            reason=f"billed {len(jobs)} times: {len(rows)} extra job(s), {incident.duplicate_amount_cents}¢ "
                   f"({'; '.join(sorted({r['cause'].split(';')[0] for r in rows}))})",
            data={"kept": kept.vendor_job_id, "duplicates": sorted(new), "amount_cents": incident.duplicate_amount_cents},
        )
        log_event("duplicate_billing", logging.WARNING, task_id=task_id, channel=kept.channel_id, count=len(rows))
    return incident


# --- the vendors' ledgers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LedgerSyncReport:
    channel: str
    added: int
    pages: int
    complete: bool
    summary: str
    retry_in_s: float | None = None


def ledger_sync(*, channel: VendorChannel, page_size: int = 1000, max_pages: int = 100,
                budget_s: float = LEDGER_BUDGET_S) -> LedgerSyncReport:
    """Copy new ledger entries of one channel, page after page from where the last sync stopped.

    A 429, a 5xx or a broken connection is retried (Retry-After first, then backoff) within the
    sync's own time budget. A sync that could not finish says so, keeps its cursor, and is due
    again later: it never reports "done" for what it did not read."""
    health = health_for(channel)
    if not capabilities_for(channel).billing_ledger:
        summary = f"not applicable: {channel.dialect} publishes no usage ledger (billing is known from our job records)"
        ChannelHealth.objects.filter(pk=channel.pk).update(ledger_sync_status=summary, ledger_synced_at=timezone.now(),
                                                           ledger_sync_due_at=None)
        return LedgerSyncReport(channel.name, 0, 0, True, summary)
    vendor = adapter_for(channel)
    cursor = health.ledger_cursor or None
    deadline = time.monotonic() + timescale.seconds(budget_s)
    added = pages = 0
    stopped = None
    for _ in range(max_pages):
        page, stopped = _ledger_page(vendor, channel, cursor=cursor, limit=page_size, deadline=deadline)
        if page is None:
            break
        pages += 1
        for entry in page.entries:
            added += _ledger_entry_store(channel, entry)
        cursor = page.next_cursor
        if cursor:
            ChannelHealth.objects.filter(pk=channel.pk).update(ledger_cursor=cursor)
        if not cursor:
            break
    else:
        stopped = f"more than {max_pages} pages"
    now = timezone.now()
    if stopped is None:
        summary = f"complete: {added} new entries in {pages} page(s)"
        ChannelHealth.objects.filter(pk=channel.pk).update(ledger_sync_status=summary, ledger_synced_at=now,
                                                           ledger_sync_due_at=None)
        return LedgerSyncReport(channel.name, added, pages, True, summary)
    retry_in = LEDGER_RETRY_S * random.uniform(0.5, 1.0)
    summary = (f"incomplete: {pages} page(s) read ({added} new entries), stopped by {stopped}; "
               f"the rest of the ledger is not read yet, will retry in {retry_in:.0f}s")
    ChannelHealth.objects.filter(pk=channel.pk).update(
        ledger_sync_status=summary[:300], ledger_synced_at=now, ledger_sync_due_at=timescale.after(retry_in, now=now),
    )
    log_event("ledger_sync_incomplete", logging.WARNING, channel=channel.name, count=pages, reason=stopped)
    return LedgerSyncReport(channel.name, added, pages, False, summary, retry_in_s=retry_in)


def _ledger_page(vendor: VendorAdapter, channel: VendorChannel, *, cursor: str | None, limit: int,
                 deadline: float) -> tuple[BillingPage | None, str | None]:
    """One page, retried within the budget; (page, None) or (None, why it stopped)."""
    policy = RetryPolicy.for_channel(channel)
    why = "the time budget"
    for attempt in range(LEDGER_TRIES_PER_PAGE):
        try:
            return vendor.list_billing(cursor=cursor, limit=limit), None
        except VendorError as err:
            why = f"{err.error_class or err.code} ({err.message})"
            if err.outcome not in (Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS):
                return None, why
            wait = timescale.seconds(policy.delay_s(attempt + 1, err.retry_after_s))
            if time.monotonic() + wait > deadline:
                return None, why
            time.sleep(wait)
    return None, why


def _ledger_entry_store(channel: VendorChannel, entry: BillingEntry) -> int:
    _, created = LedgerEntry.objects.get_or_create(
        channel=channel, entry_id=entry.entry_id,
        defaults=dict(
            job_id=entry.job_id, client_ref=entry.client_ref[:100], idempotency_key=entry.idempotency_key[:255],
            units=entry.units, unit=entry.unit[:20], amount_cents=entry.amount_cents, billed_at=_time(entry.created_at),
        ),
    )
    return int(created)


def _time(value: str | None) -> datetime:
    parsed = parse_datetime(value or "") if value else None
    return parsed or timezone.now()


def task_of_client_ref(client_ref: str) -> Task | None:
    """Our client_refs are `<task id>-<operation number>`."""
    task_id = client_ref.rsplit("-", 1)[0] if client_ref.count("-") >= 5 else client_ref
    try:
        return Task.objects.filter(pk=task_id).first()
    except Exception:
        return None


LEDGER_CHECK_BATCH = 2000
# An entry no job and no client_ref of ours names is matched again in every check for this long
# (Sluice may learn its job later: a create answered after the sync read the bill, a job adopted
# by reconciliation), then taken as not ours and no longer read.
LEDGER_MATCH_WINDOW_S = 7 * 86400


def duplicates_from_ledger() -> int:
    """Report each task the vendors' ledgers bill more than once that its incident does not fully
    name yet. Only what changed is read: the entries not matched yet are matched with the task
    they bill (by their job, else by their client_ref), and each task they bill is looked at with
    all its entries (a task is billed twice only when a second entry for it arrives). Returns how
    many incidents were opened or grew."""
    reported, after = 0, 0
    give_up_before = timezone.now() - timescale.delta(LEDGER_MATCH_WINDOW_S)
    while True:
        fresh = list(LedgerEntry.objects.filter(checked_at__isnull=True, pk__gt=after).order_by("id")[:LEDGER_CHECK_BATCH])
        if not fresh:
            return reported
        after = fresh[-1].pk
        jobs = _jobs_billed(fresh)
        by_task: dict[Any, list[int]] = defaultdict(list)
        for entry in fresh:
            task_id = jobs.get((entry.channel_id, entry.job_id))
            if task_id is None and entry.client_ref:
                task = task_of_client_ref(entry.client_ref)
                task_id = task.pk if task else None
            if task_id is not None or entry.synced_at < give_up_before:
                by_task[task_id].append(entry.pk)
        for task_id, entry_ids in by_task.items():
            LedgerEntry.objects.filter(pk__in=entry_ids).update(task_id=task_id)
        for task_id in by_task.keys() - {None}:
            reported += _ledger_report(task_id)
        # Matched only once reported: a check cut off in between matches them again next time.
        # The entries not matched yet stay unchecked, for the next check.
        LedgerEntry.objects.filter(pk__in=[pk for ids in by_task.values() for pk in ids]).update(checked_at=timezone.now())


def _jobs_billed(entries: list[LedgerEntry]) -> dict[tuple[str, str], Any]:
    """(channel, vendor job id) → task, for the jobs these entries bill that Sluice knows."""
    wanted: dict[str, set[str]] = defaultdict(set)
    for entry in entries:
        wanted[entry.channel_id].add(entry.job_id)
    found = {}
    for channel_id, job_ids in wanted.items():  # read by the (channel, job) index
        found.update({(channel_id, job_id): task_id for job_id, task_id in VendorJob.objects.filter(
            channel_id=channel_id, vendor_job_id__in=job_ids).values_list("vendor_job_id", "task_id")})
    return found


def _ledger_report(task_id: Any) -> int:
    """1 if the task's ledger entries bill it more than once and its incident did not name them all yet."""
    entries = list(LedgerEntry.objects.filter(task_id=task_id).order_by("billed_at", "id"))
    if len(entries) < 2:
        return 0
    incident = DuplicateIncident.objects.filter(task_id=task_id).first()
    named = set(incident.duplicate_job_ids) | {incident.kept_job_id} if incident else set()
    if {e.job_id for e in entries} <= named:
        return 0
    task = Task.objects.get(pk=task_id)
    for entry in entries:
        job, created = VendorJob.objects.get_or_create(
            channel_id=entry.channel_id, vendor_job_id=entry.job_id,
            defaults=dict(task=task, client_ref=entry.client_ref, idempotency_key=entry.idempotency_key,
                          status="unknown", adopted=True, amount_cents=entry.amount_cents,
                          billing_units=entry.units, billing_unit=entry.unit, cancel_requested_at=timezone.now()),
        )
        if not created and job.amount_cents is None:
            VendorJob.objects.filter(pk=job.pk).update(amount_cents=entry.amount_cents)
    if task_billing_check(task_id) is None:
        return 0
    lifecycle.record_event(task_id, generation=task.generation, actor="billing reconciliation",
                           reason=f"the vendors' ledgers bill this task {len(entries)} times",
                           data={"jobs": [e.job_id for e in entries]})
    return 1


def billing_reconcile() -> dict[str, Any]:
    """Sync every channel's ledger and report tasks billed more than once; run by housekeeping,
    by the dispatcher when an incomplete sync is due again, and on demand."""
    added = 0
    incomplete = []
    for channel in VendorChannel.objects.filter(enabled=True):
        report = ledger_sync(channel=channel)
        added += report.added
        if not report.complete:
            incomplete.append({"channel": channel.name, "summary": report.summary})
    return {"ledger_entries": added, "duplicates_reported": duplicates_from_ledger(), "incomplete": incomplete}


def ledger_sync_due(channel_name: str) -> dict[str, Any]:
    """An incomplete sync of one channel, tried again."""
    channel = VendorChannel.objects.filter(pk=channel_name, enabled=True).first()
    if channel is None:
        return {"skipped": channel_name}
    report = ledger_sync(channel=channel)
    return {"ledger_entries": report.added, "complete": report.complete, "duplicates_reported": duplicates_from_ledger()}
