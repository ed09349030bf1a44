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
from tasks.rows import Write
from tasks.services.replay import task_replay
from tasks.states import State
from tasks.storage import delete_stored, local_copy

RETENTION_DAYS = 30
LOCAL = "local"  # the local engine's channel
POISON_FAILURES = 3
VENDOR_REFUSAL_CODES_EXCLUDED = ("deadline_exceeded", "retries_exhausted", "quarantined", "input_mismatch")


def content_entries(tenant_id: Any, sha256: str) -> list[dict[str, Any]]:
    """The quarantine entries of a tenant's content (usually none), read once for a pre-check's
    decisions: which entries of an older detector its verdict releases, whether an operator let
    the content out of a poison quarantine."""
    return list(Quarantine.objects.filter(tenant_id=tenant_id, sha256=sha256).values(
        "pk", "reason", "released_at", "purged_at", "detector_version"))


def content_has_entries() -> str:
    """Whether a task's content has quarantine entries, as SQL for the task's own read
    (`tasks.rows.select` of a task with its file joined: a pre-check reads the entries only when
    there are some, and usually there are none)."""
    return (f"EXISTS (SELECT 1 FROM {Quarantine._meta.db_table} q "
            f"WHERE q.tenant_id = t.tenant_id AND q.sha256 = r_file.sha256)")


def released_from_poison(entries: list[dict[str, Any]]) -> bool:
    return any(e["reason"] == Quarantine.Reason.POISON and e["released_at"] is not None for e in entries)


def file_precheck(*, file: FileVersion, entries: list[dict[str, Any]] | None = None) -> FileVersion:
    """Run the sandboxed pre-check once per file version and record what it found. `entries`:
    the content's quarantine entries as `content_entries` read them (read here if not given)."""
    file, recorded = file_precheck_with(file=file, entries=entries)
    if recorded is not None:
        recorded.run()
    return file


def file_precheck_with(*, file: FileVersion, entries: list[dict[str, Any]] | None = None) -> tuple[FileVersion, Write | None]:
    """file_precheck, a file that passes recorded by the write returned (the verdict, unless
    another worker's came first), for the caller to make with the move the verdict decides (in its
    statement: `lifecycle.transition(writes=…)`) whatever came of that move; the file is as the
    verdict left it. A quarantined file's verdict is recorded here (None returned)."""
    with local_copy(file.storage_name) as source:
        result = run_precheck(source, file.extension)
    state = FileVersion.Precheck.PASSED if result.verdict == "pass" else FileVersion.Precheck.QUARANTINED
    verdict = dict(precheck_state=state, precheck_findings=result.findings,
                   precheck_version=result.findings.get("detector_version", DETECTOR_VERSION), prechecked_at=timezone.now())
    recorded = Write.change(FileVersion, verdict, {"id": file.pk, "precheck_state": FileVersion.Precheck.PENDING},
                            if_moved=False)
    if state == FileVersion.Precheck.PASSED:
        for name, value in verdict.items():
            setattr(file, name, value)
    elif recorded.run():
        for name, value in verdict.items():
            setattr(file, name, value)
        recorded = None
    else:
        file.refresh_from_db()  # another worker's pre-check of this file came first: its verdict holds
        recorded = None
    if file.precheck_state == FileVersion.Precheck.QUARANTINED:
        quarantine_add(file=file, reason=result.reason or "corrupt_file", findings=result.findings)
    else:
        # The same content held by an older version of the pre-check passes now: that entry was
        # a verdict of the detector it was made by, not of the content forever.
        if entries is None:
            entries = content_entries(file.tenant_id, file.sha256)
        older = [e["pk"] for e in entries if e["released_at"] is None and e["purged_at"] is None
                 and e["detector_version"] != file.precheck_version and e["reason"] != Quarantine.Reason.POISON]
        if older:
            Quarantine.objects.filter(pk__in=older, released_at__isnull=True).update(
                released_at=timezone.now(), released_by=f"re-evaluated by {file.precheck_version}"[:150],
            )
    log_event("precheck", file_id=file.pk, decision=result.verdict, reason=result.reason)
    return file, recorded


def quarantine_add(*, file: FileVersion, reason: str, findings: dict[str, Any], converter_version: str = "") -> Quarantine:
    entry = Quarantine.objects.filter(file=file, released_at__isnull=True, purged_at__isnull=True).first()
    if entry:
        return entry
    return Quarantine.objects.create(
        tenant_id=file.tenant_id, file=file, sha256=file.sha256, reason=reason,
        detector_version=findings.get("detector_version", DETECTOR_VERSION), converter_version=converter_version,
        findings=findings, expires_at=timezone.now() + timedelta(days=RETENTION_DAYS),
    )


def poison_check(*, task: Task, engine_version: str | None = None) -> Quarantine | None:
    """Content that keeps failing at the vendor is quarantined instead of being retried forever.
    On the local engine the count is per engine version (`engine_version`, read now when not
    given): what broke one LibreOffice is judged again by the next (poison_reevaluate)."""
    failures = Task.objects.filter(
        tenant_id=task.tenant_id, file__sha256=task.file.sha256, state=State.FAILED, error_retryable=False,
    ).exclude(error_code__in=VENDOR_REFUSAL_CODES_EXCLUDED)
    findings: dict[str, Any] = {}
    converter = task.channel_id or ""
    if task.channel_id == LOCAL:
        from tasks import engine

        converter = engine_version or engine.engine_version()
        # Any of the task's jobs: one found by reconciling (its create's answer lost) is not the
        # task's current job.
        failures = failures.filter(channel_id=LOCAL, vendor_jobs__engine_version=converter).distinct()
        findings["engine_version"] = converter
    count = failures.count()
    if count < POISON_FAILURES:
        return None
    file = task.file
    FileVersion.objects.filter(tenant_id=task.tenant_id, sha256=file.sha256).update(
        precheck_state=FileVersion.Precheck.QUARANTINED
    )
    where = f"the engine ({converter})" if task.channel_id == LOCAL else "the vendor"
    entry = quarantine_add(
        file=file, reason=Quarantine.Reason.POISON,
        findings={**(file.precheck_findings or {}), "verdict": "quarantine", "reason": "poison", **findings,
                  "notes": [f"{count} tasks on this content failed at {where}"]},
        converter_version=converter,
    )
    log_event("quarantined_poison", task_id=task.pk, count=count, converter=converter)
    return entry


def poison_binding(entry: Quarantine, *, engine_version: str | None = None) -> bool:
    """An engine's poison verdict binds only while that engine version converts."""
    engine_made = entry.reason == Quarantine.Reason.POISON and "engine_version" in (entry.findings or {})
    if not engine_made:
        return True
    if engine_version is None:
        from tasks import engine

        engine_version = engine.engine_version() if engine.installed() else entry.converter_version
    return entry.converter_version == engine_version


def poison_reevaluate() -> int:
    """After an engine upgrade, content the old version could not convert is let through again:
    the entry is released (its file passes the pre-check again) so the next task on it is
    converted by the new version, in the unknown-risk lane's budget; N more failures there make it
    poison again, under the new version. Finished tasks are not revived (operators may replay them)."""
    from tasks import engine

    if not engine.installed():
        return 0
    version = engine.engine_version()
    lifted = 0
    for entry in Quarantine.objects.filter(reason=Quarantine.Reason.POISON, released_at__isnull=True, purged_at__isnull=True):
        if poison_binding(entry, engine_version=version):
            continue
        actor = f"re-evaluated: engine upgraded to {version}"
        _lift(entry, actor=actor, findings={"reevaluated_from": entry.converter_version})
        AuditEntry.objects.create(actor="engine", action="quarantine_reevaluate", target_type="quarantine",
                                  target_id=str(entry.pk), done=1,
                                  detail={"from": entry.converter_version, "to": version})
        log_event("poison_reevaluated", quarantine_id=entry.pk, converter_from=entry.converter_version, converter_to=version)
        lifted += 1
    return lifted


def _lift(entry: Quarantine, *, actor: str, params: dict | None = None, findings: dict | None = None) -> None:
    """The entry no longer holds its content: released, and its file versions pass again."""
    file = entry.file
    with transaction.atomic():
        Quarantine.objects.filter(pk=entry.pk).update(released_at=timezone.now(), released_by=actor[:150],
                                                      release_params=params or {})
        FileVersion.objects.filter(tenant_id=entry.tenant_id, sha256=entry.sha256).update(
            precheck_state=FileVersion.Precheck.PASSED,
            precheck_findings={**(file.precheck_findings or {}), **(findings or {}), "released": True, "verdict": "pass"},
        )


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
    entry.file = file
    _lift(entry, actor=actor, params=params)
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
        delete_stored(file.storage_name)
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
