"""Helpers that drive Sluice the way its users do (API calls) and read what happened."""

from __future__ import annotations

import json
from datetime import timedelta

from django.test import Client
from django.utils import timezone

from tasks.models import FileVersion, Task, TenantQuota
from tasks.poc import files


def submit_file(api: Client, content: bytes | None = None, *, name: str = "a.wav", kind: str = "transcription",
                target: str = "txt", priority: str = "interactive", key: str | None = None, **extra) -> str:
    content = files.wav() if content is None else content
    stored = api.post("/api/v1/files", data=content, content_type="application/octet-stream", HTTP_X_FILENAME=name)
    assert stored.status_code == 201, stored.content
    body = {"file_id": stored.json()["id"], "kind": kind, "target_format": target, "priority": priority, **extra}
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    answer = api.post("/api/v1/tasks", data=json.dumps(body), content_type="application/json", **headers)
    assert answer.status_code == 202, answer.content
    return answer.json()["id"]


def route(task_id: str) -> Task:
    """Run the pre-check and routing step in this process (as the control cluster would)."""
    from tasks.services.intake import task_precheck_and_route

    task = Task.objects.get(pk=task_id)
    task_precheck_and_route(task.pk, task.generation)
    return Task.objects.get(pk=task_id)


def state(task_id: str) -> str:
    return Task.objects.values_list("state", flat=True).get(pk=task_id)


def downloaded(answer) -> bytes:
    """A result download's bytes, wherever the result lives: streamed by Sluice (local files) or
    behind the pre-signed link Sluice redirects to (a bucket)."""
    if answer.status_code == 302:
        import httpx

        fetched = httpx.get(answer["Location"], timeout=30)
        assert fetched.status_code == 200, fetched.text[:300]
        return fetched.content
    return b"".join(answer.streaming_content) if answer.streaming else answer.content


def stored_bytes(file) -> bytes:
    """A stored file's bytes, wherever it lives (SLUICE_DATA_DIR or a bucket)."""
    from tasks.storage import open_stored

    with open_stored(file.storage_name) as handle:
        return handle.read()


def quota_set(tenant, **fields) -> None:
    """Change a tenant's quota as an operator does in the console (the row is saved)."""
    quota = TenantQuota.objects.get(tenant=tenant)
    for name, value in fields.items():
        setattr(quota, name, value)
    quota.save()


def stored_task(tenant, **extra) -> Task:
    """A task row of a stored (unchecked) file, written directly (ACCEPTED, generation 0, unless
    `extra` says otherwise): for tests of what writes a task, without the intake around it."""
    file = FileVersion.objects.create(tenant=tenant, sha256="ab" * 32, size=10, detected_type="audio/x-wav",
                                      extension="wav", label="a.wav", storage_name="x")
    return Task.objects.create(tenant=tenant, file=file, kind="transcription", target_format="txt",
                               deadline_at=timezone.now() + timedelta(hours=1), **extra)


def logged(caplog, event: str) -> list[dict]:
    """The fields of each structured log line `event` that Sluice wrote (tasks.observability.log_event)."""
    return [record.sluice for record in caplog.records if getattr(record, "sluice", {}).get("event") == event]
