"""Billing reconciliation: our vendor jobs against each vendor's usage ledger.

The ledger is the vendor's word on what it billed. Syncing it catches what a task alone cannot:
a duplicate that appeared after the task finished (a stalled request completing late at a vendor
that ignores keys), jobs billed with no task, jobs billed but failed.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db.models import Count
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks import lifecycle
from tasks.models import DuplicateIncident, LedgerEntry, Task, VendorChannel, VendorJob
from tasks.observability import log_event
from tasks.vendor.breaker import health_for
from tasks.vendor.client import VendorClient
from tasks.vendor.errors import VendorError


def ledger_sync(*, channel: VendorChannel, max_pages: int = 100) -> int:
    """Copy new ledger entries of one channel; returns how many were added."""
    health = health_for(channel)
    client = VendorClient(channel)
    cursor = health.ledger_cursor or None
    added = 0
    for _ in range(max_pages):
        try:
            page = client.usage(cursor=cursor, limit=1000)
        except VendorError:
            break
        for entry in page.get("data", []):
            _, created = LedgerEntry.objects.get_or_create(
                channel=channel, entry_id=str(entry["entry_id"]),
                defaults=dict(
                    job_id=str(entry.get("job_id") or ""), client_ref=str(entry.get("client_ref") or "")[:100],
                    idempotency_key=str(entry.get("idempotency_key") or "")[:255], units=entry.get("units") or 0,
                    unit=str(entry.get("unit") or "")[:20], amount_cents=int(entry.get("amount_cents") or 0),
                    billed_at=_time(entry.get("created_at")),
                ),
            )
            added += created
        next_cursor = page.get("next_cursor")
        if not next_cursor:
            break
        cursor = next_cursor
        type(health).objects.filter(pk=health.pk).update(ledger_cursor=cursor)
    return added


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


def duplicates_from_ledger(*, channel: VendorChannel) -> int:
    """Report every operation the ledger billed more than once that no incident names yet."""
    reported = 0
    groups = (
        LedgerEntry.objects.filter(channel=channel).exclude(client_ref="")
        .values("client_ref").annotate(n=Count("id")).filter(n__gt=1)
    )
    for group in groups:
        client_ref = group["client_ref"]
        entries = list(LedgerEntry.objects.filter(channel=channel, client_ref=client_ref).order_by("billed_at", "id"))
        job_ids = [e.job_id for e in entries]
        incident = DuplicateIncident.objects.filter(channel=channel, client_ref=client_ref).first()
        task = task_of_client_ref(client_ref)
        if task is None:
            continue
        kept = task.vendor_job.vendor_job_id if task.vendor_job_id and task.vendor_job.vendor_job_id in job_ids else job_ids[0]
        extras = [j for j in job_ids if j != kept]
        if incident is not None and set(extras) <= set(incident.duplicate_job_ids):
            continue
        amount = sum(e.amount_cents for e in entries if e.job_id in extras)
        keep_row = VendorJob.objects.filter(channel=channel, vendor_job_id=kept).first()
        for job_id in extras:
            row, created = VendorJob.objects.get_or_create(
                channel=channel, vendor_job_id=job_id,
                defaults=dict(task=task, client_ref=client_ref, status="unknown", adopted=True, duplicate_of=keep_row,
                              cancel_requested_at=timezone.now()),
            )
            if not created and row.duplicate_of_id is None and row.pk != (keep_row.pk if keep_row else None):
                VendorJob.objects.filter(pk=row.pk).update(duplicate_of=keep_row)
        if incident is None:
            DuplicateIncident.objects.create(task=task, channel=channel, client_ref=client_ref, kept_job_id=kept,
                                             duplicate_job_ids=extras, duplicate_amount_cents=amount)
        else:
            DuplicateIncident.objects.filter(pk=incident.pk).update(duplicate_job_ids=extras, duplicate_amount_cents=amount)
        lifecycle.record_event(task.pk, generation=task.generation, actor="billing reconciliation",
                               reason=f"duplicate billing found in the vendor's ledger: {len(extras)} extra job(s)",
                               data={"kept": kept, "duplicates": extras, "amount_cents": amount})
        log_event("duplicate_billing", logging.WARNING, task_id=task.pk, channel=channel.name, count=len(extras))
        reported += 1
    return reported


def billing_reconcile() -> dict[str, int]:
    """Sync every channel's ledger and report duplicates; run by housekeeping and on demand."""
    added = reported = 0
    for channel in VendorChannel.objects.filter(enabled=True):
        added += ledger_sync(channel=channel)
        reported += duplicates_from_ledger(channel=channel)
    return {"ledger_entries": added, "duplicates_reported": reported}
