"""Retention and orphan sweeps (run every ten minutes by the django-q2 schedule)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils import timezone

from tasks import timescale
from tasks.counters import counts_check
from tasks.models import DeadLetter, FileVersion, IdempotencyRecord, Quarantine, Task, Tenant
from tasks.services.billing import billing_reconcile
from tasks.services.intake import forget_keys, key_kept_since
from tasks.services.quarantine import poison_reevaluate, quarantine_expire
from tasks.states import TERMINAL_STATES, State
from tasks.storage import (
    StorageUnavailable,
    bucket_storage,
    delete_stored,
    discard_result,
    stored_results,
)


def housekeeping() -> dict[str, int]:
    return {
        **billing_reconcile(),
        "orphan_results": remove_orphan_results(),
        "expired_results": expire_results(),
        "quarantine_expired": quarantine_expire(),
        "poison_reevaluated": poison_reevaluate(),
        "idempotency_pruned": prune_idempotency_keys(),
        "originals_expired": expire_originals(),
        "dead_letters_purged": purge_dead_letters(),
        "engine_jobs_pruned": prune_engine_jobs(),
        "task_counts_repaired": counts_check(repair=True),
    }


def prune_engine_jobs(*, older_than_s: float = 24 * 3600) -> int:
    """Finished local-engine jobs (their results were fetched into Sluice's own storage) and
    uploads no job needs any more are removed after a day."""
    import json
    import shutil
    import time

    from tasks.vendors.local import root

    base = root()
    now = time.time()
    removed = 0
    needed: set[str] = set()
    for job_dir in (base / "jobs").iterdir():
        try:
            status = json.loads((job_dir / "status.json").read_text())
            request = json.loads((job_dir / "request.json").read_text())
        except (OSError, ValueError):
            continue
        if status.get("status") in ("completed", "failed", "canceled") and now - status.get("finished_at", now) > older_than_s:
            shutil.rmtree(job_dir, ignore_errors=True)
            removed += 1
        else:
            needed.add(Path(request.get("input", "")).name)
    for upload in (base / "uploads").iterdir():
        if upload.name not in needed and now - upload.stat().st_mtime > older_than_s:
            upload.unlink(missing_ok=True)
    return removed


def expire_originals() -> int:
    """Uploaded files past their tenant's retention are deleted once no task still needs them (every
    task on them finished); the record stays, with its digest, so history still reads."""
    removed = 0
    now = timezone.now()
    candidates = (file for tenant in Tenant.objects.all() for file in FileVersion.objects.filter(
        tenant=tenant, deleted_at__isnull=True, created_at__lt=now - timescale.delta(tenant.file_retention_days * 86400),
    ).iterator())
    for file in candidates:
        if Task.objects.filter(file=file).exclude(state__in=TERMINAL_STATES).exists():
            continue
        if Quarantine.objects.filter(file=file, released_at__isnull=True, purged_at__isnull=True).exists():
            continue  # held content follows the quarantine's own retention
        delete_stored(file.storage_name)
        FileVersion.objects.filter(pk=file.pk, deleted_at__isnull=True).update(deleted_at=now)
        removed += 1
    return removed


def purge_dead_letters() -> int:
    """Dead letters past their tenant's retention are deleted (they only reference their task)."""
    purged = 0
    now = timezone.now()
    for tenant in Tenant.objects.all():
        cutoff = now - timescale.delta(tenant.dead_letter_retention_days * 86400)
        count, _ = DeadLetter.objects.filter(tenant=tenant, created_at__lt=cutoff).delete()
        purged += count
    return purged


def remove_orphan_results(*, older_than_s: float = 3600) -> int:
    """Results no task references (a fenced attempt's late output, one stored by a worker that died
    before it could publish it) are removed once they are an hour old (nominal): in the bucket when
    there is one, and the local scratch copies under RESULTS_DIR in either mode. A result's name
    starts with its task's id, so each batch of old results is checked against its own tasks' rows
    (by primary key), never against every path the task table names."""
    cutoff = timezone.now().timestamp() - timescale.seconds(older_than_s)
    removed = 0
    if bucket_storage() is not None:
        try:
            for relative in _unreferenced(name for name, modified in stored_results() if modified < cutoff):
                discard_result(relative)
                removed += 1
        except StorageUnavailable:
            pass  # the store did not answer: the next sweep goes on (the other sweeps still run)
    root = Path(settings.RESULTS_DIR)
    local = (str(path.relative_to(root)) for path in (root.glob("*/*") if root.exists() else ())
             if path.is_file() and path.stat().st_mtime < cutoff)
    # With a bucket, every local result is a scratch copy.
    for relative in (local if bucket_storage() is not None else _unreferenced(local)):
        (root / relative).unlink(missing_ok=True)
        removed += 1
    return removed


ORPHAN_BATCH = 500


def _unreferenced(names: Iterator[str]) -> Iterator[str]:
    """The results among `names` ("<task id>/<file>") that their task does not name as its result."""
    for batch in iter(lambda: list(islice(names, ORPHAN_BATCH)), []):
        ids = {_task_id(name) for name in batch} - {None}
        named = set(Task.objects.filter(pk__in=ids).exclude(result_path="").values_list("result_path", flat=True))
        yield from (name for name in batch if name not in named)


def _task_id(name: str) -> Any:
    try:
        return Task._meta.pk.to_python(name.split("/", 1)[0])
    except ValidationError:
        return None  # not a task's: no task names it


def expire_results() -> int:
    """Results past their tenant's retention are deleted; the task keeps its digest. Each tenant's
    are read by an index of the tasks still holding a result, oldest first (a partial index: not
    every task that ever succeeded, every ten minutes)."""
    removed = 0
    now = timezone.now()
    for tenant in Tenant.objects.all():
        cutoff = now - timescale.delta(tenant.result_retention_days * 86400)
        expired = (Task.objects.filter(tenant=tenant, state=State.SUCCEEDED, finished_at__lt=cutoff)
                   .exclude(result_path="").order_by("finished_at").values_list("pk", "result_path"))
        for task_id, result_path in expired.iterator():
            try:
                discard_result(result_path)
            except StorageUnavailable:
                return removed  # the store did not answer: the next sweep goes on from here
            Task.objects.filter(pk=task_id).update(result_path="")
            removed += 1
    return removed


def prune_idempotency_keys(*, chunk: int = 1000) -> int:
    """Keys kept past their time are forgotten by their tasks (intake forgets one at once when
    it is used again first), a chunk of tasks at a time so that their rows are locked only
    briefly; the records the releases before migration 0025 wrote beside them are deleted.
    Returns the keys forgotten."""
    cutoff = key_kept_since(timezone.now())
    pruned = 0
    while expired := list(Task.objects.filter(idempotency_key__isnull=False, created_at__lt=cutoff)
                          .values_list("pk", flat=True)[:chunk]):
        pruned += forget_keys(expired)
    IdempotencyRecord.objects.filter(created_at__lt=cutoff).delete()
    return pruned
