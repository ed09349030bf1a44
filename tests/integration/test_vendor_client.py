"""The vendor client against the real fake vendor: every row of the classification table, as a
task experiences it, with 0 lost tasks and 0 undetected duplicate billing."""

from __future__ import annotations

import time

import pytest

from tasks.models import DuplicateIncident, Task, TaskEvent, VendorCall, VendorChannel, VendorJob
from tasks.poc import files
from tests.conftest import TEST_TIME_SCALE, run_until, wait_for
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def primary_only():
    VendorChannel.objects.filter(name="fallback").update(enabled=False)


def reasons(task: Task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).values_list("reason", flat=True))


def journal_for(vendor, endpoint: str) -> list[dict]:
    return [e for e in vendor.control.journal() if e["endpoint"] == endpoint and e["channel"] == "primary"]


def billed(vendor) -> int:
    return vendor.control.invariants()["billed_jobs"]


# --- provably not processed: retry with the same key ----------------------------------------------
@pytest.mark.parametrize("params", [{"retry_after_s": 7}, {"retry_after_s": 7, "retry_after_date": True, "status": 503}],
                         ids=["seconds", "http-date"])
def test_rate_limited_create_waits_at_least_retry_after_and_reuses_the_key(inline_queue, api, params):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "rate_limit", "params": params, "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    creates = journal_for(inline_queue, "POST /v1/jobs")
    assert [c["status"] for c in creates] == [params.get("status", 429), 201]
    assert creates[0]["idempotency_key"] == creates[1]["idempotency_key"]
    waited = creates[1]["ts"] - creates[0]["ts"]
    assert waited >= 7 * TEST_TIME_SCALE * 0.9, f"waited {waited:.3f}s, Retry-After said 7 (scaled {7 * TEST_TIME_SCALE})"
    assert billed(inline_queue) == 1
    assert any(e.to_state == "RETRY_WAIT" for e in task.events.all())


def test_key_in_use_409_is_retried_with_the_same_key(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "http_error",
                                   "params": {"status": 409, "code": "idempotency_key_in_use"}, "times": 2})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and billed(inline_queue) == 1
    assert len({c["idempotency_key"] for c in journal_for(inline_queue, "POST /v1/jobs")}) == 1


def test_connect_errors_are_retried_then_wait_for_the_vendor_to_come_back(inline_queue, api):
    primary_only()
    from tasks.system import free_port

    VendorChannel.objects.filter(name="primary").update(base_url=f"http://127.0.0.1:{free_port()}/primary", max_attempts=2)
    from tasks.services.dispatch import tick

    task_id = submit_file(api)
    task = wait_for(lambda: tick() and Task.objects.filter(pk=task_id).exclude(waiting_reason="retry_backoff")
                    .exclude(state__in=["ACCEPTED", "QUEUED", "RUNNING"]).first(), message="the retries to end")
    assert task.state == "RETRY_WAIT" and task.waiting_reason == "all_channels_down"
    calls = VendorCall.objects.filter(task=task, operation="upload")
    assert calls.count() == 2 and set(calls.values_list("outcome", flat=True)) == {"not_processed"}
    assert not task.dead_letters.exists()


def test_a_reset_in_the_middle_of_an_upload_replays_the_file_from_byte_zero(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/uploads", "type": "reset",
                                   "params": {"stage": "mid_body", "after_bytes": 20_000}, "times": 1})
    task = run_until(submit_file(api, files.wav(10)))
    assert task.state == "SUCCEEDED"
    uploads = journal_for(inline_queue, "POST /v1/uploads")
    assert [u["outcome"] for u in uploads] == ["reset mid-body", "ok"]
    assert uploads[1]["bytes_in"] == task.file.size
    assert billed(inline_queue) == 1


# --- ambiguous: reconcile before anything else --------------------------------------------------
def test_an_inline_create_reset_mid_body_is_reconciled_then_resent_with_the_same_key(inline_queue, api):
    VendorChannel.objects.filter(name="primary").update(enabled=False)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "reset",
                                   "params": {"stage": "mid_body", "after_bytes": 10_000}, "times": 1})
    task = run_until(submit_file(api, files.wav(5)))
    assert task.state == "SUCCEEDED" and task.channel_id == "fallback"
    creates = [e for e in inline_queue.control.journal() if e["endpoint"] == "POST /v1/jobs"]
    lists = [e for e in inline_queue.control.journal() if e["endpoint"] == "GET /v1/jobs"]
    assert len(creates) == 2 and creates[0]["idempotency_key"] == creates[1]["idempotency_key"]
    assert lists and lists[0]["ts"] < creates[1]["ts"], "reconciliation must happen before the resend"
    assert billed(inline_queue) == 1


@pytest.mark.parametrize("mode", ["reset", "close", "stall"])
def test_a_lost_create_response_is_reconciled_and_the_job_adopted(inline_queue, api, mode):
    primary_only()
    VendorChannel.objects.filter(name="primary").update(upload_buffer_s=2, status_timeout_s=2)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": mode}, "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    assert len(journal_for(inline_queue, "POST /v1/jobs")) == 1, "no second create after the lost answer"
    assert billed(inline_queue) == 1
    assert VendorJob.objects.get(task=task).adopted
    assert any("adopted vendor job" in r for r in reasons(task))


@pytest.mark.parametrize("status", [500, 502, 504])
def test_gateway_errors_on_create_are_reconciled_before_a_resend(inline_queue, api, status):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "http_error", "params": {"status": status}, "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and billed(inline_queue) == 1
    assert any(e.to_state == "RECONCILING" for e in task.events.all())


@pytest.mark.parametrize("stall_ms,processing_ms", [(12_000, 30_000), (30_000, 1000)],
                         ids=["lands-before-the-result", "lands-after-the-result"])
def test_a_stalled_create_that_completes_late_at_a_key_ignoring_vendor_is_caught_as_duplicate_billing(
        inline_queue, api, stall_ms, processing_ms):
    """The article's incident: timeout, resend, two jobs billed. Sluice detects, cancels and reports
    — also when the stalled create is billed only after the resent one's result came back (a task
    whose create was ambiguous is audited again a while after it ends)."""
    primary_only()
    VendorChannel.objects.filter(name="primary").update(upload_buffer_s=1, status_timeout_s=1)
    control = inline_queue.control
    control.add_rule({"endpoint": "POST /v1/jobs", "type": "stall", "params": {"ms": stall_ms}, "times": 1})
    control.add_rule({"endpoint": "POST /v1/jobs", "type": "ignore_idempotency"})
    control.channel("primary", processing_ms=processing_ms)
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    incident = incident_of(task)
    vendor_dups = control.invariants()["duplicate_billed_client_refs"]
    assert [d["client_ref"] for d in vendor_dups] == [task.vendor_client_ref]
    assert incident.kept_job_id == task.vendor_job.vendor_job_id
    assert set(incident.duplicate_job_ids) | {incident.kept_job_id} == set(vendor_dups[0]["jobs"])
    assert incident.duplicate_amount_cents > 0
    assert any("billed 2 times" in r for r in reasons(task))


def incident_of(task: Task, *, timeout: float = 30.0) -> DuplicateIncident:
    """The task's duplicate-billing incident, once an audit (at once or a follow-up the dispatcher
    sends) has found it."""
    from tasks.services.dispatch import tick

    def found() -> DuplicateIncident | None:
        tick()
        return DuplicateIncident.objects.filter(task=task).first()

    return wait_for(found, timeout=timeout, message=f"a duplicate-billing incident for {task.pk}")


def test_an_audit_that_cannot_list_the_jobs_is_tried_again_later(inline_queue, api):
    """A vendor that double-creates, then fails every listing for a while: the duplicate is still
    found, by an audit the dispatcher sends again, not lost with the failed call."""
    primary_only()
    control = inline_queue.control
    control.channel("primary", processing_ms=1000)
    control.add_rule({"endpoint": "POST /v1/jobs", "type": "duplicate_create", "params": {"copies": 2}, "times": 1})
    control.add_rule({"endpoint": "GET /v1/jobs", "type": "http_error", "params": {"status": 503}, "times": 2})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    assert len(journal_for(inline_queue, "GET /v1/jobs")) == 2, "both audits so far failed"
    incident = incident_of(task)
    assert len(incident.duplicate_job_ids) == 1
    assert Task.objects.get(pk=task.pk).billing_audit_due_at is None, "a successful audit is not repeated"


def test_duplicate_create_is_detected_and_the_extra_jobs_cancelled(inline_queue, api):
    primary_only()
    inline_queue.control.channel("primary", processing_ms=4000)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "duplicate_create", "params": {"copies": 3}, "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    incident = DuplicateIncident.objects.get(task=task)
    assert len(incident.duplicate_job_ids) == 2
    extras = VendorJob.objects.filter(vendor_job_id__in=incident.duplicate_job_ids)
    assert extras.count() == 2 and all(j.cancel_requested_at for j in extras)


def test_a_job_created_finished_is_audited_once_in_its_step_and_its_duplicates_caught(inline_queue, api):
    """A vendor that answers the create with the job completed: the step lists the operation's
    jobs once (right after the create, before the download), not again after the download a few
    milliseconds later; the extra jobs a duplicating create billed are found by that list."""
    primary_only()
    inline_queue.control.channel("primary", processing_ms=0, queue_ms=0)
    plain = run_until(submit_file(api))
    assert plain.state == "SUCCEEDED"
    assert len(journal_for(inline_queue, "GET /v1/jobs")) == 1, "the job was listed again after its download"
    assert not DuplicateIncident.objects.filter(task=plain).exists()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "duplicate_create", "params": {"copies": 3}, "times": 1})
    task = run_until(submit_file(api, files.with_marker(files.wav(1), b"duplicated")))
    assert task.state == "SUCCEEDED"
    assert len(journal_for(inline_queue, "GET /v1/jobs")) == 2
    incident = DuplicateIncident.objects.get(task=task)
    assert len(incident.duplicate_job_ids) == 2
    assert VendorJob.objects.filter(vendor_job_id__in=incident.duplicate_job_ids).count() == 2


# --- refused: fail with an actionable message, no retry ------------------------------------------------
@pytest.mark.parametrize("status,code,needle", [
    (400, "invalid_request", "check kind"),
    (403, "forbidden", "forbids"),
    (413, "file_too_large", "larger than the vendor accepts"),
    (415, "unsupported_format", "does not support"),
])
def test_refusals_fail_at_once_with_an_actionable_message(inline_queue, api, status, code, needle):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "http_error", "params": {"status": status, "code": code}})
    task = run_until(submit_file(api))
    assert task.state == "FAILED" and task.error_code == code and needle in task.error_message
    assert len(journal_for(inline_queue, "POST /v1/jobs")) == 1 and task.retries == 0


def test_a_wrong_api_key_is_a_refusal_not_a_retry(inline_queue, api):
    primary_only()
    VendorChannel.objects.filter(name="primary").update(api_key="wrong")
    task = run_until(submit_file(api))
    assert task.state == "FAILED" and task.error_code == "unauthenticated" and "api_key" in task.error_message


def test_an_idempotency_key_mismatch_fails_and_raises_an_alarm(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "http_error",
                                   "params": {"status": 422, "code": "idempotency_key_mismatch"}})
    task = run_until(submit_file(api))
    assert task.state == "FAILED" and task.error_code == "idempotency_key_mismatch"
    assert TaskEvent.objects.filter(task=task, data__alarm=True).exists()


# --- polling and results ------------------------------------------------------------------------------------
def test_a_result_whose_digest_does_not_match_is_never_published(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "digest_mismatch", "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    flagged = VendorJob.objects.get(task=task, integrity_flag="result_digest_mismatch")
    assert task.vendor_job_id != flagged.pk
    assert billed(inline_queue) == 2  # the flagged job was billed; the retry made a new operation


def test_a_job_not_yet_visible_is_polled_again_not_failed(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "transient_404", "params": {"ms": 6000}})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and billed(inline_queue) == 1


def test_a_rate_limited_poll_waits_as_told(inline_queue, api):
    primary_only()
    inline_queue.control.channel("primary", processing_ms=2000)
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs/*", "type": "rate_limit", "params": {"retry_after_s": 10}, "times": 1})
    task = run_until(submit_file(api))
    polls = journal_for(inline_queue, "GET /v1/jobs/*")
    assert task.state == "SUCCEEDED" and polls[0]["status"] == 429
    assert polls[1]["ts"] - polls[0]["ts"] >= 10 * TEST_TIME_SCALE * 0.9


def test_a_retryable_job_failure_retries_as_a_new_operation(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail",
                                   "params": {"code": "engine_busy", "retryable": True}, "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    keys = {c["idempotency_key"] for c in journal_for(inline_queue, "POST /v1/jobs")}
    assert len(keys) == 2, "a finished failed job needs a new key, or the vendor would replay the failure"


def test_a_non_retryable_job_failure_fails_the_task_with_the_vendors_code(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail", "params": {"code": "bad_audio"}})
    task = run_until(submit_file(api))
    assert task.state == "FAILED" and task.error_code == "vendor_bad_audio" and billed(inline_queue) == 1


def test_polls_start_slow_and_back_off(inline_queue, api):
    from tasks.services.dispatch import tick

    primary_only()
    inline_queue.control.channel("primary", processing_ms=60_000)
    task_id = submit_file(api)
    scheduled: list[float] = []  # each poll interval Sluice planned, in nominal seconds
    deadline = time.monotonic() + 60
    while (task := Task.objects.get(pk=task_id)).state not in ("SUCCEEDED", "FAILED") and time.monotonic() < deadline:
        if task.poll_interval_s and (not scheduled or scheduled[-1] != task.poll_interval_s):
            scheduled.append(task.poll_interval_s)
        tick()
        time.sleep(0.02)
    assert task.state == "SUCCEEDED"
    # Doubling from the channel's first interval, up to its cap.
    channel = VendorChannel.objects.get(name="primary")
    assert scheduled[0] == channel.poll_initial_s and len(scheduled) >= 3, scheduled
    assert all(later == min(earlier * 2, channel.poll_max_interval_s) for earlier, later in zip(scheduled, scheduled[1:]))
    # At the vendor, no poll comes before its planned interval (jitter and a loaded machine only
    # make a gap longer), and a one-minute job costs a handful of polls.
    polls = journal_for(inline_queue, "GET /v1/jobs/*")
    gaps = [b["ts"] - a["ts"] for a, b in zip(polls, polls[1:])]
    assert all(gap >= interval * TEST_TIME_SCALE * 0.95 for gap, interval in zip(gaps, scheduled[1:])), (gaps, scheduled)
    assert len(polls) <= 8, f"{len(polls)} polls for a one-minute job"


# --- time layers --------------------------------------------------------------------------------------
def test_a_size_derived_upload_timeout_copes_with_a_slow_link_a_fixed_one_does_not(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/uploads", "type": "bandwidth", "params": {"bytes_per_s": 100_000}})
    content = files.wav(60)  # ~960 kB: ~9.6 nominal seconds over this link
    VendorChannel.objects.filter(name="primary").update(
        upload_timeout_policy="fixed", upload_fixed_timeout_s=3, max_attempts=2)
    fixed = run_until(submit_file(api, content), timeout=60)
    assert fixed.state == "FAILED" and fixed.error_code == "retries_exhausted"
    assert VendorCall.objects.filter(task=fixed, operation="upload", outcome="ambiguous").count() == 2
    VendorChannel.objects.filter(name="primary").update(
        upload_timeout_policy="size_derived", upload_bandwidth_bytes_s=80_000, upload_buffer_s=5)
    derived = run_until(submit_file(api, content), timeout=60)
    assert derived.state == "SUCCEEDED"
    assert inline_queue.control.invariants()["duplicate_billed_client_refs"] == []
    assert billed(inline_queue) == 1


def test_a_duplicate_billed_after_the_task_finished_is_caught_by_ledger_reconciliation(inline_queue, api):
    import time

    from tasks.services.billing import billing_reconcile

    primary_only()
    VendorChannel.objects.filter(name="primary").update(upload_buffer_s=1, status_timeout_s=1, audit_after_create=False)
    control = inline_queue.control
    control.add_rule({"endpoint": "POST /v1/jobs", "type": "stall", "params": {"ms": 30_000}, "times": 1})
    control.add_rule({"endpoint": "POST /v1/jobs", "type": "ignore_idempotency"})
    control.channel("primary", processing_ms=200)
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and not DuplicateIncident.objects.exists()
    time.sleep(30_000 / 1000 * TEST_TIME_SCALE + 0.3)  # the stalled create now completes: a second bill
    assert control.invariants()["duplicate_billed_client_refs"]
    assert billing_reconcile()["duplicates_reported"] == 1
    incident = DuplicateIncident.objects.get(task=task)
    assert incident.kept_job_id == task.vendor_job.vendor_job_id and len(incident.duplicate_job_ids) == 1
    assert billing_reconcile()["duplicates_reported"] == 0  # reported once


def test_a_cookie_a_vendor_sets_is_never_sent_back(transactional_db):
    """Vendor APIs authenticate by header; the pooled client a process keeps per vendor must not
    carry a cookie set in the answer to one task's call into the next task's calls."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tasks.vendors.http import VendorHttp, problem_details

    seen: list[str | None] = []

    class SetsCookies(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's protocol
            seen.append(self.headers.get("Cookie"))
            body = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Set-Cookie", f"session=task-{len(seen)}; Path=/")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SetsCookies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        VendorChannel.objects.filter(name="primary").update(base_url=f"http://127.0.0.1:{server.server_port}/cookies")
        channel = VendorChannel.objects.get(pk="primary")
        for task_id in (None, None, None):
            http = VendorHttp(channel, task_id=task_id, auth_headers={"Authorization": "Bearer k"},
                              error_details=problem_details)
            assert http.call("get_job", "GET", "/v1/jobs/1") == {"ok": True}
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [None, None, None]
