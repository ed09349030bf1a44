"""Retention of originals and dead letters, quarantine keyed by detector version, poison content,
and who may see dead letters (issue 15)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from console.staff import staff_ensure
from tasks.models import DeadLetter, FileVersion, Quarantine, Task, VendorChannel
from tasks.poc import files
from tasks.services.housekeeping import expire_originals, purge_dead_letters
from tasks.storage import stored_exists
from tests.conftest import run_until
from tests.support.flows import route, submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def test_originals_past_retention_are_deleted_once_no_task_needs_them(inline_queue, api):
    done = run_until(submit_file(api))
    live = route(submit_file(api, files.wav(2)))
    FileVersion.objects.update(created_at=timezone.now() - timedelta(days=31))
    assert expire_originals() == 1
    kept, gone = FileVersion.objects.get(pk=live.file_id), FileVersion.objects.get(pk=done.file_id)
    assert gone.deleted_at is not None and not stored_exists(gone.storage_name)
    assert kept.deleted_at is None and stored_exists(kept.storage_name), "a task still needs this file"
    assert Task.objects.get(pk=done.pk).result_sha256, "the task's history and digests stay"


def test_dead_letters_past_retention_are_purged(inline_queue, api):
    task = run_until(submit_file(api))
    DeadLetter.objects.create(task=task, tenant=task.tenant, error_class="retryable", error_code="x", attempts=1)
    recent = DeadLetter.objects.create(task=task, tenant=task.tenant, error_class="retryable", error_code="y", attempts=1)
    DeadLetter.objects.exclude(pk=recent.pk).update(created_at=timezone.now() - timedelta(days=91))
    assert purge_dead_letters() == 1 and list(DeadLetter.objects.all()) == [recent]


def test_content_quarantined_by_an_older_detector_is_checked_again_not_blocked_forever(inline_queue, api, tenant):
    content = files.wav(2)
    first = api.post("/api/v1/files", data=content, content_type="application/octet-stream", HTTP_X_FILENAME="a.wav").json()
    old = Quarantine.objects.create(
        tenant=tenant, file_id=first["id"], sha256=first["sha256"], reason="corrupt_file", detector_version="precheck-0.9",
        findings={"reason": "corrupt_file"}, expires_at=timezone.now() + timedelta(days=30),
    )
    task = run_until(submit_file(api, content))
    assert task.state == "SUCCEEDED", "an old detector's verdict blocked content the current one passes"
    old.refresh_from_db()
    assert old.released_at is not None and old.released_by.startswith("re-evaluated by precheck-")


def test_content_that_keeps_failing_at_the_vendor_is_quarantined_as_poison(inline_queue, api):
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail", "params": {"code": "engine_crash"}})
    content = files.wav(3)
    for _ in range(3):
        assert run_until(submit_file(api, content)).state == "FAILED"
    entry = Quarantine.objects.get(reason="poison")
    assert entry.converter_version and FileVersion.objects.filter(sha256=entry.sha256, precheck_state="quarantined").exists()
    stored = api.post("/api/v1/files", data=content, content_type="application/octet-stream", HTTP_X_FILENAME="a.wav").json()
    import json

    refused = api.post("/api/v1/tasks", data=json.dumps({"file_id": stored["id"], "kind": "transcription",
                                                        "target_format": "txt"}), content_type="application/json")
    assert refused.status_code == 422 and refused.json()["code"] == "file_quarantined"
    assert inline_queue.control.invariants()["billed_jobs"] == 3, "the poison content was not sent a fourth time"


def test_the_third_failure_and_the_poison_verdict_commit_together(inline_queue, api, monkeypatch):
    """A worker that dies after the third task's move to FAILED and before the verdict must not
    leave the content failed three times and still accepted: the move is undone with it (the
    task is still the worker's, for the watchdog to fence and the step to be taken again)."""
    from tasks.services import quarantine

    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail", "params": {"code": "engine_crash"}})
    content = files.wav(3)
    for _ in range(2):
        assert run_until(submit_file(api, content)).state == "FAILED"

    def worker_dies(**kwargs):
        raise RuntimeError("the worker died before the verdict was written")

    monkeypatch.setattr(quarantine, "quarantine_add", worker_dies)
    third = submit_file(api, content)
    with pytest.raises(AssertionError, match="stuck in RUNNING"):
        run_until(third, timeout=3)
    assert Task.objects.filter(state="FAILED").count() == 2 and not Quarantine.objects.exists()
    monkeypatch.undo()
    # Its next failure (here: the step taken again by hand, as the fenced step would be) judges it.
    from tasks.services.execution.retry import refused

    task = Task.objects.get(pk=third)
    refused(task, source="RUNNING", code="vendor_engine_crash", message="the job failed")
    assert Task.objects.get(pk=third).state == "FAILED" and Quarantine.objects.get(reason="poison")


@pytest.mark.parametrize("role,status", [("viewer", 403), ("qa", 403), ("operator", 200), ("admin", 200)])
def test_dead_letters_are_seen_by_operators_and_above_only(client, role, status):
    user, password = staff_ensure(username=f"{role}-user", role=role, actor="test")
    assert client.login(username=user.username, password=password)
    assert client.get(reverse("admin:tasks_deadletter_changelist")).status_code == status


def test_content_whose_failed_jobs_are_found_by_reconciliation_is_quarantined_as_poison(inline_queue, api):
    """The create's answer is lost, so each task learns of its failed job by reconciling: those
    failures count towards the poison verdict as much as the ones a poll reports (the vendor
    fails each job at once, so reconciliation finds it failed already)."""
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    inline_queue.control.channel("primary", processing_ms=1)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail", "params": {"code": "engine_crash"}})
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "reset"}})
    content = files.wav(3)
    for _ in range(3):
        task = run_until(submit_file(api, content))
        assert (task.state, task.error_code) == ("FAILED", "vendor_engine_crash"), (task.state, task.error_code)
        reasons = [e.reason for e in task.events.order_by("pk")]
        assert reasons[-2].endswith("reconcile before any retry"), f"the failure was not found by reconciling: {reasons}"
    entry = Quarantine.objects.get(reason="poison")
    assert FileVersion.objects.filter(sha256=entry.sha256, precheck_state="quarantined").exists()
    assert inline_queue.control.invariants()["billed_jobs"] == 3
