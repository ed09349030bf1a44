"""End to end: intake, real django-q2 workers, the dispatcher and the real fake vendor over HTTP."""

import pytest
from django_q.brokers import get_broker

from tasks.models import Task, TaskEvent, VendorJob
from tasks.poc import files
from tasks.queueing import send_step
from tests.conftest import wait_for
from tests.support.flows import downloaded, state, submit_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_submitted_task_succeeds_and_its_result_matches_its_digest(system, vendor, api):
    task_id = submit_file(api, files.wav(3), kind="transcription", target="srt")
    wait_for(lambda: state(task_id) in ("SUCCEEDED", "FAILED"), timeout=60, message="a terminal state")
    task = Task.objects.get(pk=task_id)
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    download = api.get(f"/api/v1/tasks/{task_id}/result")
    body = downloaded(download)
    import hashlib

    assert download["X-Content-SHA256"] == hashlib.sha256(body).hexdigest() == task.result_sha256
    assert b"-->" in body  # an SRT transcript
    invariants = vendor.control.invariants()
    assert invariants["billed_jobs"] == 1 and invariants["duplicate_billed_client_refs"] == []
    steps = list(TaskEvent.objects.filter(task=task).values_list("to_state", flat=True))
    assert [s for s in steps if s] == ["ACCEPTED", "QUEUED", "RUNNING", "SUCCEEDED"]


def test_a_job_the_vendor_finishes_as_it_creates_it_is_fetched_in_the_start_step(system, vendor, api):
    """A fast engine answers the create with the job completed: nothing is polled, the result is
    fetched in the same step, and the task's history says both in one entry that its stages read
    (no time at the vendor, the download as the fetching stage)."""
    vendor.control.channel("primary", processing_ms=0, queue_ms=0)
    task_id = submit_file(api, files.wav(2), kind="transcription", target="txt")
    wait_for(lambda: state(task_id) in ("SUCCEEDED", "FAILED"), timeout=60, message="a terminal state")
    task = Task.objects.get(pk=task_id)
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    # A step's successful calls are written together as it ends, just after its last move.
    wait_for(lambda: task.vendor_calls.filter(operation="get_result").exists(), timeout=10,
             message="the step's vendor calls to be written")
    operations = [c.operation for c in task.vendor_calls.order_by("id")]
    assert operations[:2] == ["upload", "create_job"] and "get_result" in operations, operations
    assert not {"get_job", "poll"} & set(operations), operations  # never polled
    reasons = [e.reason for e in TaskEvent.objects.filter(task=task).order_by("at", "id") if not e.to_state]
    assert reasons == ["vendor job created; the vendor completed the job"], reasons
    stages = api.get(f"/api/v1/tasks/{task_id}").json()["stages"]
    assert stages["vendor_queued"] == 0 and stages["vendor_processing"] is None
    assert stages["fetching"] is not None and stages["fetching"] >= 0, stages


def test_a_conversion_through_the_inline_fallback_channel(system, vendor, api):
    from tasks.models import VendorChannel

    VendorChannel.objects.filter(name="primary").update(enabled=False)
    task_id = submit_file(api, files.docx(), name="report.docx", kind="conversion", target="pdf", priority="batch")
    wait_for(lambda: state(task_id) in ("SUCCEEDED", "FAILED"), timeout=60, message="a terminal state")
    task = Task.objects.get(pk=task_id)
    assert task.state == "SUCCEEDED", task.error_message
    assert task.channel_id == "fallback" and task.result_content_type == "application/pdf"


def test_a_lost_dispatch_message_is_sent_again_and_the_task_still_runs(vendor, api, tmp_path):
    from tasks.system import Stack
    from tests.conftest import TEST_TIME_SCALE

    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05"})
    try:
        task_id = submit_file(api, files.wav())
        # The broker loses the pre-check message sent to the task's lane right after the commit.
        broker = get_broker(Task.objects.get(pk=task_id).lane_id)
        assert broker.queue_size() == 1
        broker.purge_queue()
        assert state(task_id) == "ACCEPTED"
        stack.start_dispatcher()
        stack.start_all_clusters(workers=1)
        wait_for(lambda: state(task_id) == "SUCCEEDED", timeout=60, message="recovery of the lost message")
    finally:
        stack.stop_all()
    assert vendor.control.invariants()["billed_jobs"] == 1


def test_a_message_taken_by_a_cluster_that_died_before_running_it_is_sent_again(vendor, api, tmp_path):
    from django.conf import settings
    from django_q.models import OrmQ

    from tasks.system import Stack
    from tests.conftest import TEST_TIME_SCALE

    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05"})
    try:
        task_id = submit_file(api, files.wav())
        # A pusher takes the pre-check message, and its cluster is killed before a worker runs it.
        broker = get_broker(Task.objects.get(pk=task_id).lane_id)
        assert len(broker.dequeue() or []) == 1
        if not settings.REDIS_URL:  # a lane's message is taken by deleting it: the broker never redelivers it
            assert not OrmQ.objects.filter(key=broker.list_key).exists()
        stack.start_dispatcher()
        stack.start_all_clusters(workers=1)
        wait_for(lambda: state(task_id) == "SUCCEEDED", timeout=60, message="recovery of the taken message")
    finally:
        stack.stop_all()
    assert vendor.control.invariants()["billed_jobs"] == 1


def test_a_message_waiting_behind_a_backlog_is_not_resent_but_a_lost_one_is(vendor, api):
    """No workers: the lane's queue really holds the message, and the dispatcher must tell a
    message waiting its turn from a lost one (or a backlog doubles itself with resends)."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks.services.dispatch import resend_cutoff, tick

    task_id = submit_file(api, files.wav())
    broker = get_broker(Task.objects.get(pk=task_id).lane_id)

    def sent_before(moment):
        Task.objects.filter(pk=task_id).update(due_at=moment, enqueued_at=moment)

    sent_before(resend_cutoff(timezone.now()) - timedelta(seconds=1))
    tick()
    assert broker.queue_size() == 1, "still queued behind others: not lost, not resent"
    broker.purge_queue()
    tick()
    assert broker.queue_size() == 1, "lost (the queue is empty): sent again"
    # Under a backlog that never drains, a message is still presumed lost, only later.
    sent_before(resend_cutoff(timezone.now(), busy=True) - timedelta(seconds=1))
    tick()
    assert broker.queue_size() == 2


def test_duplicated_messages_run_nothing_twice(system, vendor, api):
    task_id = submit_file(api, files.wav())
    wait_for(lambda: state(task_id) == "SUCCEEDED", timeout=60, message="success")
    task = Task.objects.get(pk=task_id)
    events_before = TaskEvent.objects.filter(task=task).count()
    requests_before = len(vendor.control.journal())
    for step in ("precheck", "start", "poll", "reconcile", "cancel"):
        for generation in range(task.generation + 1):
            send_step(step, task.pk, generation, lane=task.lane_id)
    import time

    time.sleep(2)
    assert state(task_id) == "SUCCEEDED"
    assert TaskEvent.objects.filter(task=task).count() == events_before
    assert len(vendor.control.journal()) == requests_before
    assert VendorJob.objects.filter(task=task).count() == 1
