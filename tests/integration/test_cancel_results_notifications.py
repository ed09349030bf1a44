"""Cancellation races, result publication and storage, and notifications that never re-run work."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import connection
from django.utils import timezone

from tasks.models import DeadLetter, Notification, Task, TaskEvent, Tenant, VendorChannel, VendorJob
from tasks.services import execution
from tasks.services.cancel import task_cancel
from tasks.services.notifications import notification_deliver, notification_resend
from tasks.storage import result_exists, result_file
from tests.conftest import run_until, wait_for
from tests.support.flows import downloaded, route, submit_file

pytestmark = pytest.mark.django_db(transaction=True)


class Receiver:
    """A business system's endpoint that fails `fail_first` times, then acknowledges."""

    def __init__(self, fail_first: int) -> None:
        self.calls: list[tuple[dict, dict]] = []
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.calls.append((json.loads(body), {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(500 if len(receiver.calls) <= receiver.fail_first else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def receiver_factory(settings):
    settings.CALLBACK_ALLOW_PRIVATE = True
    made = []

    def make(fail_first: int) -> Receiver:
        made.append(Receiver(fail_first))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


def primary_only():
    VendorChannel.objects.filter(name="fallback").update(enabled=False)


# --- cancel -----------------------------------------------------------------------------------------------
def test_cancel_while_running_stops_at_the_vendor_and_frees_the_slot(inline_queue, api):
    primary_only()
    inline_queue.control.channel("primary", processing_ms=600_000, cancel_delay_ms=2000)
    task_id = submit_file(api)
    run_until(task_id, states=("RUNNING",))
    wait_for(lambda: Task.objects.get(pk=task_id).phase == "poll", message="the job to be created")
    answer = api.post(f"/api/v1/tasks/{task_id}/cancel")
    assert answer.status_code == 202 and answer.json()["state"] == "CANCEL_REQUESTED"
    task = run_until(task_id, states=("CANCELLED",))
    job = VendorJob.objects.get(task=task)
    assert job.status == "canceled" and job.terminal_at is not None
    assert inline_queue.control.invariants()["running_jobs"] == 0
    reasons = list(TaskEvent.objects.filter(task=task).values_list("reason", flat=True))
    assert any("waiting for the execution to stop" in r for r in reasons) and any("cancel confirmed" in r for r in reasons)


def test_success_that_commits_first_makes_the_cancel_answer_409_already_finished(inline_queue, api):
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    answer = api.post(f"/api/v1/tasks/{task.pk}/cancel")
    assert answer.status_code == 409 and answer.json()["code"] == "already_finished" and answer.json()["state"] == "SUCCEEDED"


def test_a_cancel_that_wins_discards_the_late_result_and_removes_its_file(vendor, api):
    """The worker is downloading the result when the cancel commits: its success loses the CAS."""
    primary_only()
    vendor.control.channel("primary", processing_ms=100)
    vendor.control.add_rule({"endpoint": "GET /v1/jobs/*/result", "type": "delay", "params": {"ms": 20_000}})
    task = route(submit_file(api))
    execution.step_start(task.pk, Task.objects.get(pk=task.pk).generation)
    running = Task.objects.get(pk=task.pk)
    time.sleep(0.3)
    outcome = {}

    def poll():
        try:
            outcome["poll"] = execution.step_poll(running.pk, running.generation)
        finally:
            connection.close()

    worker = threading.Thread(target=poll)
    worker.start()
    wait_for(lambda: Task.objects.get(pk=task.pk).phase == "fetch", message="the download to start")
    assert task_cancel(task_id=task.pk, actor="user").state == "CANCEL_REQUESTED"
    worker.join()
    assert outcome["poll"] == "discarded"
    execution.step_cancel(task.pk, Task.objects.get(pk=task.pk).generation)
    final = Task.objects.get(pk=task.pk)
    assert final.state == "CANCELLED" and final.result_path == ""
    folder = result_file(str(task.pk))
    assert not folder.exists() or not any(folder.iterdir())
    assert TaskEvent.objects.filter(task=task, reason__startswith="late result discarded").exists()


# --- results ---------------------------------------------------------------------------------------------------
def test_an_expiring_signed_link_downloads_the_result_and_a_tampered_one_does_not(inline_queue, api, client, settings):
    task = run_until(submit_file(api))
    link = api.post(f"/api/v1/tasks/{task.pk}/result-link").json()
    answer = client.get(link["url"].replace("http://testserver", ""))
    body = downloaded(answer)
    assert answer.status_code in (200, 302) and hashlib.sha256(body).hexdigest() == task.result_sha256
    assert client.get(link["url"].replace("http://testserver", "")[:-2] + "xx").status_code == 404
    settings.SIGNED_URL_TTL_S = -1
    assert client.get(link["url"].replace("http://testserver", "")).status_code == 410


def test_results_past_retention_and_orphaned_outputs_are_swept(inline_queue, api, monkeypatch):
    from django.core.files.base import ContentFile

    from tasks.services import housekeeping
    from tasks.services.housekeeping import expire_results, remove_orphan_results
    from tasks.storage import bucket_storage, stored_results

    # Results are checked against their tasks in batches: one a batch here, so that every kept
    # result and every orphan falls in a batch of its own.
    monkeypatch.setattr(housekeeping, "ORPHAN_BATCH", 1)
    task, other = run_until(submit_file(api)), run_until(submit_file(api))
    orphans = [result_file(f"{t.pk}/g99-orphan.out") for t in (task, other)]
    stray = result_file("not-a-task/g1-stray.out")  # under no task's id: no task can name it
    for path in (*orphans, stray):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"left by a fenced attempt")
    if bucket_storage() is not None:  # stored by a worker that died before publishing them
        for name in (f"{task.pk}/g98-orphan.out", f"{other.pk}/g98-orphan.out", "not-a-task/g1-stray.out"):
            bucket_storage().save(f"results/{name}", ContentFile(b"never published"))
        assert sorted(name for name, _ in stored_results(task.pk)) == sorted([task.result_path, f"{task.pk}/g98-orphan.out"])
    assert remove_orphan_results(older_than_s=0) >= 3
    assert not any(path.exists() for path in (*orphans, stray))
    assert sorted(name for name, _ in stored_results()) == sorted([task.result_path, other.result_path])
    assert result_exists(task.result_path) and result_exists(other.result_path)
    Task.objects.filter(pk=task.pk).update(finished_at=timezone.now() - timedelta(days=400))
    assert expire_results() == 1
    assert api.get(f"/api/v1/tasks/{task.pk}/result").status_code == 409 or not result_exists(task.result_path)


# --- notifications -------------------------------------------------------------------------------------------------
def deliver_all(task: Task, *, rounds: int) -> None:
    for _ in range(rounds):
        Notification.objects.filter(task=task, status="pending").update(next_attempt_at=timezone.now())
        for note in Notification.objects.filter(task=task, status="pending"):
            notification_deliver(notification_id=note.pk)


def test_a_receiver_that_fails_twice_then_acknowledges_gets_one_signed_event_and_nothing_reruns(inline_queue, api, receiver_factory):
    receiver = receiver_factory(fail_first=2)
    task = run_until(submit_file(api, callback_url=receiver.url))
    deliver_all(task, rounds=5)
    note = Notification.objects.get(task=task)
    assert note.status == "delivered" and note.attempts == 3
    event_ids = {call[0]["event_id"] for call in receiver.calls}
    assert event_ids == {str(note.event_id)} and len(receiver.calls) == 3
    event, headers, raw = receiver.calls[-1]
    expected = hmac.new(task.tenant.callback_secret.encode(), raw, hashlib.sha256).hexdigest()
    assert headers["x-sluice-signature"] == f"sha256={expected}" and event["task"]["state"] == "SUCCEEDED"
    assert Task.objects.get(pk=task.pk).attempts == 1 and inline_queue.control.invariants()["billed_jobs"] == 1


def test_a_receiver_that_never_acknowledges_exhausts_delivery_and_an_operator_can_resend(inline_queue, api, receiver_factory):
    receiver = receiver_factory(fail_first=10_000)
    task = run_until(submit_file(api, callback_url=receiver.url))
    Notification.objects.filter(task=task).update(max_attempts=3)
    deliver_all(task, rounds=5)
    note = Notification.objects.get(task=task)
    assert note.status == "exhausted" and note.attempts == 3 and note.last_error == "http_500"
    assert notification_resend(notification_id=note.pk)
    assert Notification.objects.get(pk=note.pk).status == "pending"
    assert Task.objects.get(pk=task.pk).state == "SUCCEEDED" and Task.objects.get(pk=task.pk).attempts == 1


def test_a_replayed_task_that_succeeds_supersedes_its_undelivered_failed_event(inline_queue, api, receiver_factory):
    """The tenant never hears "failed" after "succeeded": the older event is superseded, and every
    event carries the task's generation so a receiver can order what it did get."""
    from tasks.services.replay import task_replay

    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    VendorChannel.objects.filter(name="primary").update(max_attempts=1)
    receiver = receiver_factory(fail_first=10_000)
    rule = inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail",
                                          "params": {"code": "engine_busy", "retryable": True}})
    task = run_until(submit_file(api, callback_url=receiver.url))
    assert task.state == "FAILED"
    failed = Notification.objects.get(task=task)
    assert failed.event_type == "task.failed" and failed.status in ("pending", "delivering")
    inline_queue.control.delete_rule(rule["id"])
    assert task_replay(task=task, actor="operator")
    task = run_until(task.pk)
    assert task.state == "SUCCEEDED"
    receiver.fail_first = 0  # the receiver is back, with the "failed" event still undelivered
    deliver_all(task, rounds=3)
    notes = {n.event_type: n for n in Notification.objects.filter(task=task)}
    assert notes["task.failed"].status == "superseded" and notes["task.succeeded"].status == "delivered"
    assert notes["task.succeeded"].generation > notes["task.failed"].generation
    events = [call[0] for call in receiver.calls]
    first_success = next(i for i, e in enumerate(events) if e["event"] == "task.succeeded")
    assert events[first_success]["generation"] == notes["task.succeeded"].generation
    assert not [e for e in events[first_success:] if e["event"] == "task.failed"], "failed was heard after succeeded"


def test_callback_urls_are_validated(api, settings):
    settings.CALLBACK_ALLOW_PRIVATE = False
    file_id = api.post("/api/v1/files", data=b"text document", content_type="application/octet-stream").json()["id"]
    for url, status in [("ftp://example.com/x", 400), ("http://127.0.0.1/hook", 400), ("http://10.0.0.5/x", 400),
                        ("http://user:pw@example.com/x", 400), ("https://93.184.216.34/hook", 202)]:
        answer = api.post("/api/v1/tasks", content_type="application/json", data=json.dumps(
            {"file_id": file_id, "kind": "conversion", "target_format": "txt", "callback_url": url}))
        assert answer.status_code == status, (url, answer.content)


# --- dead letters ---------------------------------------------------------------------------------------------------------
def test_spent_retries_land_in_dead_letters_by_reference_and_replay_keeps_the_task_id(inline_queue, api):
    from tasks.services.replay import task_replay

    primary_only()
    VendorChannel.objects.filter(name="primary").update(max_attempts=2)
    # Jobs the vendor runs and fails (billed each time): retried, but not without end. (A failure
    # that was provably not processed waits for recovery instead: test_money_paths.)
    rule = inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail",
                                          "params": {"code": "engine_busy", "retryable": True}})
    task = run_until(submit_file(api, name="SECRET-NAME-4711.wav"))
    assert task.state == "FAILED" and task.error_code == "retries_exhausted"
    letter = DeadLetter.objects.get(task=task)
    assert letter.attempts == 2 and letter.error_code == "retries_exhausted"
    assert "SECRET-NAME" not in repr(letter.__dict__)
    inline_queue.control.delete_rule(rule["id"])
    assert task_replay(task=task, actor="operator")
    replayed = run_until(task.pk)
    assert replayed.state == "SUCCEEDED" and replayed.pk == task.pk and replayed.generation > task.generation
    assert DeadLetter.objects.get(task=task).resolution == "replayed"


# --- vendor callbacks --------------------------------------------------------------------------------------
def test_signed_vendor_callbacks_bring_the_next_poll_forward_and_are_deduplicated(inline_queue, api, live_server, settings):
    from tasks.models import InboundVendorEvent

    settings.PUBLIC_URL = live_server.url
    primary_only()
    inline_queue.control.channel("primary", processing_ms=2000)
    task_id = submit_file(api)
    run_until(task_id, states=("RUNNING",))
    wait_for(lambda: InboundVendorEvent.objects.exists(), timeout=20, message="the vendor's signed callback")
    task = run_until(task_id)
    assert task.state == "SUCCEEDED"
    event = InboundVendorEvent.objects.get()
    body = json.dumps({"event": "job.completed", "event_id": event.event_id, "job": {"id": event.job_id}}).encode()
    signature = "sha256=" + hmac.new(b"dev-webhook-secret", body, hashlib.sha256).hexdigest()
    again = api.post("/api/v1/vendor-callbacks/primary", data=body, content_type="application/json",
                     HTTP_X_VENDOR_SIGNATURE=signature)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    forged = api.post("/api/v1/vendor-callbacks/primary", data=body, content_type="application/json",
                      HTTP_X_VENDOR_SIGNATURE="sha256=00")
    assert forged.status_code == 401


def test_the_terminal_event_goes_to_the_tenants_callback_and_without_one_an_older_event_is_still_superseded(
        inline_queue, api, receiver_factory):
    """The tenant's callback URL counts as the task's own (read when the task finishes, not when
    its step began); without any URL no event is written, and an older undelivered one is still
    superseded."""
    receiver = receiver_factory(fail_first=0)
    task = Task.objects.get(pk=submit_file(api))
    Tenant.objects.filter(pk=task.tenant_id).update(callback_url=receiver.url)
    task = run_until(task.pk)
    assert task.state == "SUCCEEDED"
    assert [(n.event_type, n.url) for n in Notification.objects.filter(task=task)] == [("task.succeeded", receiver.url)]
    Tenant.objects.filter(pk=task.tenant_id).update(callback_url="")
    quiet = run_until(submit_file(api))
    assert quiet.state == "SUCCEEDED" and not Notification.objects.filter(task=quiet).exists()
    # An older event still pending (a replay's earlier outcome) and no URL any more: superseded.
    older = Notification.objects.create(task=quiet, tenant_id=quiet.tenant_id, generation=1, url=receiver.url,
                                        event_type="task.failed", payload={},
                                        next_attempt_at=timezone.now() + timedelta(days=1))
    Task.objects.filter(pk=quiet.pk).update(state="FAILED", error_code="test")
    from tasks.services.replay import task_replay

    assert task_replay(task=Task.objects.get(pk=quiet.pk), actor="operator")
    assert run_until(quiet.pk).state == "SUCCEEDED"
    assert Notification.objects.get(pk=older.pk).status == "superseded"
