"""Quarantine: files held out of every lane, kept apart from dead letters.

A file is quarantined when its pre-check fails, crashes or times out, or when tasks on the same
content keep failing at the vendor (poison). A new upload of quarantined content by the same
tenant is recognised at once. Operators release (re-checking first if they like) or purge.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from tasks.models import AuditEntry, FileVersion, Quarantine, Task
from tasks.observability import log_event
from tasks.precheck import DETECTOR_VERSION
from tasks.precheck.sandbox import run_precheck
from tasks.services.replay import task_replay
from tasks.states import State

RETENTION_DAYS = 30
POISON_FAILURES = 3
VENDOR_REFUSAL_CODES_EXCLUDED = ("deadline_exceeded", "retries_exhausted", "quarantined", "input_mismatch")


def file_precheck(*, file: FileVersion) -> FileVersion:
    """Run the sandboxed pre-check once per file version and record what it found."""
    result = run_precheck(file.path, file.extension)
    state = FileVersion.Precheck.PASSED if result.verdict == "pass" else FileVersion.Precheck.QUARANTINED
    FileVersion.objects.filter(pk=file.pk, precheck_state=FileVersion.Precheck.PENDING).update(
        precheck_state=state, precheck_findings=result.findings,
        precheck_version=result.findings.get("detector_version", DETECTOR_VERSION), prechecked_at=timezone.now(),
    )
    file.refresh_from_db()
    if file.precheck_state == FileVersion.Precheck.QUARANTINED:
        quarantine_add(file=file, reason=result.reason or "corrupt_file", findings=result.findings)
    else:
        # The same content held by an older version of the pre-check passes now: that entry was
        # a verdict of the detector it was made by, not of the content forever.
        Quarantine.objects.filter(
            tenant_id=file.tenant_id, sha256=file.sha256, released_at__isnull=True, purged_at__isnull=True,
        ).exclude(detector_version=file.precheck_version).exclude(reason=Quarantine.Reason.POISON).update(
            released_at=timezone.now(), released_by=f"re-evaluated by {file.precheck_version}"[:150],
        )
    log_event("precheck", file_id=file.pk, decision=result.verdict, reason=result.reason)
    return file


def quarantine_add(*, file: FileVersion, reason: str, findings: dict[str, Any], converter_version: str = "") -> Quarantine:
    entry = Quarantine.objects.filter(file=file, released_at__isnull=True, purged_at__isnull=True).first()
    if entry:
        return entry
    return Quarantine.objects.create(
        tenant_id=file.tenant_id, file=file, sha256=file.sha256, reason=reason,
        detector_version=findings.get("detector_version", DETECTOR_VERSION), converter_version=converter_version,
        findings=findings, expires_at=timezone.now() + timedelta(days=RETENTION_DAYS),
    )


def _converter_version(task: Task) -> str:
    """What kept failing on the content: the local engine's version (so an engine upgrade is a new
    verdict), or the vendor channel."""
    if task.channel_id == "local":
        from tasks import engine

        return engine.engine_version()
    return task.channel_id or ""


def poison_check(*, task: Task) -> Quarantine | None:
    """Content that keeps failing at the vendor is quarantined instead of being retried forever."""
    failures = Task.objects.filter(
        tenant_id=task.tenant_id, file__sha256=task.file.sha256, state=State.FAILED, error_retryable=False,
    ).exclude(error_code__in=VENDOR_REFUSAL_CODES_EXCLUDED).count()
    if failures < POISON_FAILURES:
        return None
    file = task.file
    FileVersion.objects.filter(tenant_id=task.tenant_id, sha256=file.sha256).update(
        precheck_state=FileVersion.Precheck.QUARANTINED
    )
    entry = quarantine_add(
        file=file, reason=Quarantine.Reason.POISON,
        findings={**(file.precheck_findings or {}), "verdict": "quarantine", "reason": "poison",
                  "notes": [f"{failures} tasks on this content failed at the vendor"]},
        converter_version=_converter_version(task),
    )
    log_event("quarantined_poison", task_id=task.pk, count=failures)
    return entry


def quarantine_release(*, entry: Quarantine, actor: str, recheck: bool = False, params: dict | None = None) -> dict[str, int]:
    """Let the content through again: its failed tasks are replayed in the unknown-risk lane."""
    if not entry.is_open:
        return {"replayed": 0, "skipped": 0}
    file = entry.file
    if recheck:
        FileVersion.objects.filter(pk=file.pk).update(precheck_state=FileVersion.Precheck.PENDING)
        file.refresh_from_db()
        file = file_precheck(file=file)
        if file.precheck_state == FileVersion.Precheck.QUARANTINED:
            return {"replayed": 0, "skipped": 0, "still_failing": 1}
    now = timezone.now()
    with transaction.atomic():
        Quarantine.objects.filter(pk=entry.pk).update(released_at=now, released_by=actor[:150], release_params=params or {})
        FileVersion.objects.filter(tenant_id=entry.tenant_id, sha256=entry.sha256).update(
            precheck_state=FileVersion.Precheck.PASSED,
            precheck_findings={**(file.precheck_findings or {}), "released": True, "verdict": "pass"},
        )
    replayed = skipped = 0
    for task in Task.objects.filter(file__sha256=entry.sha256, tenant_id=entry.tenant_id, state=State.FAILED,
                                    error_code="quarantined"):
        if task_replay(task=task, actor=actor, lane_name="unknown-risk", params=params):
            replayed += 1
        else:
            skipped += 1
    AuditEntry.objects.create(actor=actor, action="quarantine_release", target_type="quarantine",
                              target_id=str(entry.pk), done=replayed, skipped=skipped,
                              detail={"reason": entry.reason, "recheck": recheck, "params": bool(params)})
    return {"replayed": replayed, "skipped": skipped}


def quarantine_purge(*, entry: Quarantine, actor: str) -> bool:
    """Delete the quarantined content from disk; the entry (and its findings) stay for the record."""
    if entry.purged_at is not None:
        return False
    files = FileVersion.objects.filter(tenant_id=entry.tenant_id, sha256=entry.sha256, deleted_at__isnull=True)
    for file in files:
        file.path.unlink(missing_ok=True)
    now = timezone.now()
    files.update(deleted_at=now)
    Quarantine.objects.filter(pk=entry.pk).update(purged_at=now)
    AuditEntry.objects.create(actor=actor, action="quarantine_purge", target_type="quarantine",
                              target_id=str(entry.pk), done=1, detail={"reason": entry.reason})
    return True


def quarantine_expire() -> int:
    """Entries past their retention are purged."""
    count = 0
    for entry in Quarantine.objects.filter(expires_at__lt=timezone.now(), purged_at__isnull=True, released_at__isnull=True):
        count += quarantine_purge(entry=entry, actor="retention")
    return count
