"""Retention and orphan sweeps (run every ten minutes by the django-q2 schedule)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from tasks import timescale
from tasks.models import IdempotencyRecord, Task
from tasks.services.billing import billing_reconcile
from tasks.services.quarantine import quarantine_expire
from tasks.states import State
from tasks.storage import result_file

IDEMPOTENCY_KEEP_S = 48 * 3600


def housekeeping() -> dict[str, int]:
    return {
        **billing_reconcile(),
        "orphan_results": remove_orphan_results(),
        "expired_results": expire_results(),
        "quarantine_expired": quarantine_expire(),
        "idempotency_pruned": prune_idempotency_keys(),
    }


def remove_orphan_results(*, older_than_s: float = 3600) -> int:
    """Result files no task references (a fenced attempt's late output) are removed."""
    root = Path(settings.RESULTS_DIR)
    if not root.exists():
        return 0
    cutoff = timezone.now().timestamp() - timescale.seconds(older_than_s)
    referenced = set(Task.objects.exclude(result_path="").values_list("result_path", flat=True))
    removed = 0
    for path in root.glob("*/*"):
        relative = str(path.relative_to(root))
        if relative not in referenced and path.stat().st_mtime < cutoff:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def expire_results() -> int:
    """Results past their tenant's retention are deleted; the task keeps its digest."""
    removed = 0
    now = timezone.now()
    for task in Task.objects.filter(state=State.SUCCEEDED).exclude(result_path="").select_related("tenant").iterator():
        if task.finished_at and task.finished_at < now - timescale.delta(task.tenant.result_retention_days * 86400):
            result_file(task.result_path).unlink(missing_ok=True)
            Task.objects.filter(pk=task.pk).update(result_path="")
            removed += 1
    return removed


def prune_idempotency_keys() -> int:
    cutoff = timezone.now() - timedelta(seconds=max(timescale.seconds(IDEMPOTENCY_KEEP_S), 24 * 3600))
    deleted, _ = IdempotencyRecord.objects.filter(created_at__lt=cutoff).delete()
    return deleted
