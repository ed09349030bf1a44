"""The vendor-side failure paths an independent vendor found (issue 13): never pay twice, never spin.

Each test drives the real fake vendor over loopback with the shipped channel defaults, unless a
setting is made harsher (a shorter poll budget, a smaller retry budget) to reach the path sooner.
"""

from __future__ import annotations

import pytest

from tasks.models import DuplicateIncident, Task, TaskEvent, VendorCall, VendorChannel, VendorJob
from tests.conftest import TEST_TIME_SCALE, run_until, wait_for
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def primary_only():
    VendorChannel.objects.filter(name="fallback").update(enabled=False)


def journal(vendor, endpoint: str) -> list[dict]:
    return [e for e in vendor.control.journal() if e["endpoint"] == endpoint]


def reasons(task: Task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).values_list("reason", flat=True))


def billed_for(vendor, task: Task) -> list[dict]:
    """The vendor's ledger entries of this task, whatever the channel or client_ref."""
    return [e for e in vendor.control.ledger() if (e["client_ref"] or "").startswith(str(task.pk))]


# --- a completed job is never abandoned -------------------------------------------------------------
def test_a_completed_job_whose_download_is_rate_limited_is_fetched_not_replaced(inline_queue, api):
    """429s on GET .../result outlast the poll budget: the job was completed (and billed), so the
    download is retried after Retry-After until it succeeds; no new job is created."""
    primary_only()
    VendorChannel.objects.filter(name="primary").update(poll_budget_s=20)
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs/*/result", "type": "rate_limit",
                                   "params": {"retry_after_s": 10}, "times": 4})
    task = run_until(submit_file(api), timeout=60)
    assert task.state == "SUCCEEDED", (task.error_code, reasons(task))
    assert len(billed_for(inline_queue, task)) == 1, "a second job was billed for a completed one"
    assert len(journal(inline_queue, "POST /v1/jobs")) == 1
    downloads = journal(inline_queue, "GET /v1/jobs/*/result")
    assert [d["status"] for d in downloads] == [429, 429, 429, 429, 200]
    for earlier, later in zip(downloads, downloads[1:]):
        assert later["ts"] - earlier["ts"] >= 10 * TEST_TIME_SCALE * 0.9, "the download came back before Retry-After"
    polls = journal(inline_queue, "GET /v1/jobs/*")
    first_download = downloads[0]["ts"]
    assert not [p for p in polls if p["ts"] > first_download], "a download failure sent the task back to polling"


def test_download_retries_of_a_completed_job_outlive_the_attempts_execution_timeout_without_a_fence(inline_queue, api):
    """Waiting out a vendor's Retry-After on a finished job's result is not an execution running
    long: the attempt is not fenced (which would poll and reconcile a job known to be done), and
    each download keeps its own full deadline. The lane's timeout is short here only so that the
    waits outlast it within the test's time."""
    from tasks.models import Lane

    primary_only()
    Lane.objects.filter(pk="interactive").update(execution_timeout_s=30)
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs/*/result", "type": "rate_limit",
                                   "params": {"retry_after_s": 20}, "times": 3})
    task = run_until(submit_file(api), timeout=60)
    assert task.state == "SUCCEEDED", (task.error_code, reasons(task))
    assert not [r for r in reasons(task) if "execution timeout" in r], reasons(task)
    downloads = journal(inline_queue, "GET /v1/jobs/*/result")
    assert [d["status"] for d in downloads] == [429, 429, 429, 200]
    assert not [p for p in journal(inline_queue, "GET /v1/jobs/*") if p["ts"] > downloads[0]["ts"]]


def test_a_download_reset_is_retried_as_a_download_and_the_poll_interval_does_not_grow(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs/*/result", "type": "reset", "times": 2})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    assert [d["status"] for d in journal(inline_queue, "GET /v1/jobs/*/result")] == [None, None, 200]
    assert len(journal(inline_queue, "POST /v1/jobs")) == 1


def test_a_job_still_running_past_the_poll_budget_is_stopped_before_a_new_one_starts(inline_queue, api):
    primary_only()
    VendorChannel.objects.filter(name="primary").update(poll_budget_s=10)
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "stuck", "params": {"ms": 600_000}, "times": 1})
    task = run_until(submit_file(api), timeout=60)
    assert task.state == "SUCCEEDED"
    first, second = sorted(VendorJob.objects.filter(task=task), key=lambda j: j.created_at)
    assert first.status == "canceled" and first.terminal_at <= second.created_at, "the executions overlapped"
    assert any("poll budget" in r for r in reasons(task))
    incident = DuplicateIncident.objects.get(task=task)
    assert incident.duplicate_job_ids == [first.vendor_job_id]


# --- billing is accounted per task ------------------------------------------------------------------
def test_a_second_billed_job_under_another_client_ref_is_a_duplicate_billing_incident(inline_queue, api):
    """A retryable vendor failure makes a new operation (a new client_ref): the task was billed
    twice, and that is reported with both amounts whatever the client_refs."""
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail",
                                   "params": {"code": "engine_busy", "retryable": True}, "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    ledger = billed_for(inline_queue, task)
    assert len({e["client_ref"] for e in ledger}) == 2 and len(ledger) == 2
    incident = DuplicateIncident.objects.get(task=task)
    assert incident.kept_job_id == task.vendor_job.vendor_job_id
    failed = next(e for e in ledger if e["job_id"] != incident.kept_job_id)
    assert incident.duplicate_job_ids == [failed["job_id"]]
    assert incident.duplicate_amount_cents == failed["amount_cents"] > 0
    assert "failed at the vendor" in incident.jobs[0]["cause"]


def test_the_ledger_check_groups_billing_by_task_not_by_client_ref(inline_queue, api):
    """Two billed jobs of one task under different client_refs that Sluice never linked live are
    found by the ledger check and reported once."""
    from tasks.services.billing import billing_reconcile

    primary_only()
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and not DuplicateIncident.objects.exists()
    # A job the vendor billed for this task under another client_ref that Sluice never saw
    # (a create whose answer never came back, under an operation that was then replaced).
    extra = inline_queue.control.create_job(channel="primary", client_ref=f"{task.pk}-9", api_key="dev-vendor-key")
    assert billing_reconcile()["duplicates_reported"] == 1
    incident = DuplicateIncident.objects.get(task=task)
    assert incident.duplicate_job_ids == [extra["id"]] and incident.duplicate_amount_cents > 0
    assert billing_reconcile()["duplicates_reported"] == 0


def test_the_ledger_check_reads_only_new_entries_and_still_sees_a_bill_that_arrives_later(inline_queue, api):
    """Each check matches only the entries it has not matched yet; a task's second bill, arriving
    in a later check than its first, is reported with the first (read by the task they bill)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tasks.models import LedgerEntry
    from tasks.services.billing import billing_reconcile, duplicates_from_ledger

    primary_only()
    task = run_until(submit_file(api))
    assert billing_reconcile()["duplicates_reported"] == 0  # its one bill, matched with it
    first = LedgerEntry.objects.get(task=task)
    assert first.checked_at is not None
    with CaptureQueriesContext(connection) as nothing_new:
        assert duplicates_from_ledger() == 0
    assert len(nothing_new.captured_queries) == 1, "a check with nothing new reads only that there is nothing"
    extra = inline_queue.control.create_job(channel="primary", client_ref=f"{task.pk}-9", api_key="dev-vendor-key")
    assert billing_reconcile()["duplicates_reported"] == 1
    incident = DuplicateIncident.objects.get(task=task)
    assert incident.kept_job_id == first.job_id and incident.duplicate_job_ids == [extra["id"]]
    assert set(LedgerEntry.objects.filter(task=task).values_list("job_id", flat=True)) == {first.job_id, extra["id"]}



def test_a_bill_the_ledger_check_could_not_match_yet_is_matched_when_sluice_learns_its_job(vendor, api):
    """A ledger entry read before Sluice recorded its job (a create whose answer came back after the
    sync, a job adopted by reconciliation) names no task yet: it is matched again in later checks,
    so the task's second bill is still reported with it."""
    from tasks.models import LedgerEntry
    from tasks.services.billing import billing_reconcile
    from tasks.services.execution.jobs import record_job
    from tasks.vendors.protocol import JobView

    primary_only()
    task = Task.objects.get(pk=submit_file(api))  # no worker runs it: its jobs are the ones below
    channel = VendorChannel.objects.get(name="primary")
    first = vendor.control.create_job(channel="primary", client_ref="", api_key="dev-vendor-key")
    assert billing_reconcile()["duplicates_reported"] == 0
    unmatched = LedgerEntry.objects.get(job_id=first["id"])
    assert unmatched.task_id is None and unmatched.checked_at is None  # nothing names its task yet: read again
    record_job(task, channel, JobView(id=first["id"], status="queued", client_ref=""), adopted=True)
    assert not DuplicateIncident.objects.filter(task=task).exists()
    second = vendor.control.create_job(channel="primary", client_ref=f"{task.pk}-9", api_key="dev-vendor-key")
    assert billing_reconcile()["duplicates_reported"] == 1
    incident = DuplicateIncident.objects.get(task=task)
    assert {incident.kept_job_id, *incident.duplicate_job_ids} == {first["id"], second["id"]}
    assert set(LedgerEntry.objects.filter(task=task).values_list("job_id", flat=True)) == {first["id"], second["id"]}


def test_a_bill_nothing_of_sluice_names_for_a_week_is_no_longer_read(vendor, api):
    """An entry that no job and no client_ref of ours names (another client's use of the account)
    is matched again for a week, then set aside: the checks do not read it for ever."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks import timescale
    from tasks.models import LedgerEntry
    from tasks.services.billing import LEDGER_MATCH_WINDOW_S, billing_reconcile, duplicates_from_ledger

    primary_only()
    job = vendor.control.create_job(channel="primary", client_ref="someone-else", api_key="dev-vendor-key")
    billing_reconcile()
    duplicates_from_ledger()
    assert LedgerEntry.objects.get(job_id=job["id"]).checked_at is None
    LedgerEntry.objects.filter(job_id=job["id"]).update(
        synced_at=timezone.now() - timescale.delta(LEDGER_MATCH_WINDOW_S) - timedelta(seconds=1))
    assert duplicates_from_ledger() == 0
    set_aside = LedgerEntry.objects.get(job_id=job["id"])
    assert set_aside.checked_at is not None and set_aside.task_id is None

# --- a vendor that forgets its jobs ---------------------------------------------------------------------
def test_a_vendor_that_forgets_a_running_job_gets_the_operation_again_and_the_task_ends(inline_queue, api):
    primary_only()
    inline_queue.control.channel("primary", processing_ms=4000)
    task_id = submit_file(api)
    wait_for(lambda: (run_until(task_id, states=("RUNNING",)) and Task.objects.get(pk=task_id).vendor_job_id),
             message="the job to be created")
    inline_queue.control.amnesia()
    task = run_until(task_id, timeout=60)
    assert task.state == "SUCCEEDED", (task.error_code, reasons(task))
    assert any(e.data.get("vendor_lost_job") for e in task.events.all()), reasons(task)
    lost = VendorJob.objects.get(task=task, status="lost")
    assert lost.terminal_at is not None
    # The resubmission used the same key; the vendor billed both jobs, and Sluice says so.
    creates = [c for c in journal(inline_queue, "POST /v1/jobs") if c["status"] == 201]
    assert len(creates) == 2 and creates[0]["idempotency_key"] == creates[1]["idempotency_key"]
    incident = DuplicateIncident.objects.get(task=task)
    assert incident.duplicate_job_ids == [lost.vendor_job_id]
    assert "lost by the vendor" in incident.jobs[0]["cause"]
    assert VendorCall.objects.filter(task=task).count() < 40, "the task spun"


def test_reconciliation_that_never_gets_an_answer_backs_off_and_asks_an_operator(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "reset"},
                                   "times": 1})
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs", "type": "http_error", "params": {"status": 500}})
    task_id = submit_file(api)
    task = run_until(task_id, states=("RECONCILING",))
    wait_for(lambda: (run_until(task_id, states=("RECONCILING",)) and
                      Task.objects.get(pk=task_id).waiting_reason == "needs_operator"),
             timeout=120, message="the task to be handed to an operator")
    task = Task.objects.get(pk=task_id)
    lists = journal(inline_queue, "GET /v1/jobs")
    assert len(lists) >= task.channel.reconcile_max_rounds
    # Full jitter under a doubling cap: eight rounds spread over about 90 nominal seconds on
    # average; without backoff they would take about eight.
    span = (lists[-1]["ts"] - lists[0]["ts"]) / TEST_TIME_SCALE
    assert span > 25, f"reconcile retries did not back off: {len(lists)} lists in {span:.1f} nominal s"
    assert task.due_at is not None, "a task waiting for an operator is still looked at"
    assert any("needs an operator" in r for r in reasons(task))
    assert not journal(inline_queue, "POST /v1/jobs")[1:], "nothing was resent blindly"


# --- answers that are no answer ----------------------------------------------------------------------------
def test_a_redirect_is_never_followed_and_is_a_refusal_naming_the_location(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/uploads", "type": "redirect",
                                   "params": {"status": 307, "location": "http://127.0.0.1:1/elsewhere"}})
    task = run_until(submit_file(api))
    assert task.state == "FAILED" and task.error_code == "redirected"
    assert "http://127.0.0.1:1/elsewhere" in task.error_message
    assert len(journal(inline_queue, "POST /v1/uploads")) == 1


def test_a_malformed_answer_to_a_create_is_reconciled_and_the_job_adopted(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "malformed", "params": {"body": "not_json"},
                                   "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    assert len(journal(inline_queue, "POST /v1/jobs")) == 1 and VendorJob.objects.get(task=task).adopted
    assert len(billed_for(inline_queue, task)) == 1


@pytest.mark.parametrize("body", ["not_json", "missing_fields", "wrong_types"])
def test_a_malformed_answer_to_a_poll_or_download_is_retried(inline_queue, api, body):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs/*", "type": "malformed", "params": {"body": body}, "times": 2})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and len(billed_for(inline_queue, task)) == 1


# --- outages of every channel ------------------------------------------------------------------------------
def test_an_outage_of_every_channel_is_a_durable_wait_that_resumes_on_recovery(inline_queue, api):
    outage = inline_queue.control.add_rule({"endpoint": "* *", "type": "http_error", "params": {"status": 503}})
    task_id = submit_file(api)
    wait_for(lambda: (run_until(task_id, states=("RETRY_WAIT", "FAILED")) and
                      Task.objects.get(pk=task_id).waiting_reason == "all_channels_down"),
             timeout=120, message="the task to wait for any channel")
    # Ten more capped backoffs of outage (600 nominal seconds): it keeps waiting, one try a round.
    waited_from = Task.objects.get(pk=task_id).updated_at
    with pytest.raises(AssertionError, match="stuck in RETRY_WAIT"):
        run_until(task_id, states=("FAILED", "SUCCEEDED", "CANCELLED", "EXPIRED"), timeout=600 * TEST_TIME_SCALE)
    task = Task.objects.get(pk=task_id)
    assert task.waiting_reason == "all_channels_down" and not task.dead_letters.exists()
    tries = VendorCall.objects.filter(task=task, at__gt=waited_from).count()
    assert 2 <= tries <= 25, f"{tries} vendor calls in ten capped backoffs"
    inline_queue.control.delete_rule(outage["id"])
    task = run_until(task_id, timeout=120)
    assert task.state == "SUCCEEDED" and not task.dead_letters.exists()


def test_a_retry_that_would_pass_the_business_deadline_fails_at_once(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "rate_limit", "params": {"retry_after_s": 120}})
    task = run_until(submit_file(api, deadline_s=60))
    assert task.state == "FAILED" and task.error_code == "deadline_exceeded"
    assert "before the next try" in task.error_message
    assert len(journal(inline_queue, "POST /v1/jobs")) == 1


def test_a_dry_retry_budget_slows_retries_down_but_the_task_still_succeeds(inline_queue, api):
    primary_only()
    VendorChannel.objects.filter(name="primary").update(retry_budget_capacity=5, max_attempts=10)
    from tasks.vendors.breaker import reset_retry_budget

    reset_retry_budget(VendorChannel.objects.get(pk="primary"))
    inline_queue.control.add_rule({"endpoint": "POST /v1/uploads", "type": "http_error", "params": {"status": 503}, "times": 2})
    task = run_until(submit_file(api), timeout=60)
    assert task.state == "SUCCEEDED"
    assert any("retry budget of primary is dry" in r for r in reasons(task))


def test_a_vendor_that_processed_another_input_is_caught_and_the_result_never_published(inline_queue, api):
    primary_only()
    inline_queue.control.add_rule({"endpoint": "POST /v1/jobs", "type": "input_digest_mismatch", "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    flagged = VendorJob.objects.get(task=task, integrity_flag="input_digest_mismatch")
    assert flagged.pk != task.vendor_job_id and flagged.vendor_job_id not in task.result_path
    assert DuplicateIncident.objects.get(task=task).duplicate_job_ids == [flagged.vendor_job_id]


# --- the billing ledger sync is honest ------------------------------------------------------------------
def test_ledger_sync_retries_rate_limits_and_pages_through_everything(inline_queue, api):
    from tasks.services.billing import ledger_sync

    primary_only()
    for _ in range(3):
        run_until(submit_file(api))
    inline_queue.control.add_rule({"endpoint": "GET /v1/usage", "type": "rate_limit", "params": {"retry_after_s": 1},
                                   "times": 2})
    report = ledger_sync(channel=VendorChannel.objects.get(pk="primary"), page_size=1)
    assert report.complete and report.added == 3 and report.pages >= 3


def test_ledger_sync_that_cannot_finish_says_incomplete_and_retries_later(inline_queue, api):
    from tasks.models import ChannelHealth
    from tasks.services.billing import ledger_sync

    primary_only()
    run_until(submit_file(api))
    inline_queue.control.add_rule({"endpoint": "GET /v1/usage", "type": "rate_limit", "params": {"retry_after_s": 1}})
    report = ledger_sync(channel=VendorChannel.objects.get(pk="primary"))
    assert not report.complete and report.added == 0
    assert "incomplete" in report.summary and "will retry" in report.summary
    health = ChannelHealth.objects.get(pk="primary")
    assert health.ledger_sync_due_at is not None and health.ledger_sync_status.startswith("incomplete")


def test_a_job_the_vendor_answers_again_for_a_replayed_key_is_recorded_once(api):
    """A create answered with a job Sluice already recorded (a replayed key) finds its record
    instead of failing or writing a second one: one job, one billing, no incident."""
    from tasks.services.execution.jobs import record_job
    from tasks.vendors.protocol import JobView

    task = Task.objects.select_related("channel").get(pk=submit_file(api))
    channel = VendorChannel.objects.get(name="primary")
    view = JobView(id="job-replayed-1", status="queued", client_ref=f"{task.pk}-1", amount_cents=12)
    first = record_job(task, channel, view, adopted=False)
    again = record_job(task, channel, view, adopted=False)
    assert again.pk == first.pk and VendorJob.objects.filter(task=task).count() == 1
    assert not DuplicateIncident.objects.filter(task=task).exists()
    # Another job for the same task is a second billing: reported at once.
    record_job(task, channel, JobView(id="job-replayed-2", status="queued", client_ref=f"{task.pk}-1"), adopted=False)
    assert DuplicateIncident.objects.get(task=task).duplicate_job_ids == ["job-replayed-2"]
