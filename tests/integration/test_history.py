"""History at a glance: the per-minute rollup counts what the task table holds, and the dashboard's
charts show exactly those numbers."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from console.staff import staff_ensure
from tasks.models import HistoryMinute, Task, TaskEvent
from tasks.services.history import error_class, floor_minute, history_rollup
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db


def finish(task_id: str, state: str, at, *, code: str = "", lane: str = "interactive", channel: str = "primary",
           wait_s: float = 0.0) -> None:
    Task.objects.filter(pk=task_id).update(state=state, error_code=code, lane_id=lane, channel_id=channel,
                                           queued_at=at - timedelta(seconds=wait_s), started_at=at, finished_at=at)
    event = TaskEvent.objects.create(task_id=task_id, generation=1, from_state="RUNNING", to_state=state, actor="test",
                                     reason="test")
    TaskEvent.objects.filter(pk=event.pk).update(at=at)  # `at` is set on insert


def test_the_rollup_counts_each_minute_per_lane_and_channel(api):
    now = timezone.now()
    minute = floor_minute(now) - timedelta(minutes=2)
    ids = [submit_file(api) for _ in range(5)]
    finish(ids[0], "SUCCEEDED", minute + timedelta(seconds=5), wait_s=1.0)
    finish(ids[1], "SUCCEEDED", minute + timedelta(seconds=20), wait_s=3.0, channel="fallback")
    finish(ids[2], "FAILED", minute + timedelta(seconds=40), code="retries_exhausted")
    finish(ids[3], "FAILED", minute + timedelta(seconds=50), code="deadline_exceeded", lane="batch")
    finish(ids[4], "SUCCEEDED", minute + timedelta(seconds=70))  # the next minute
    history_rollup(now)
    row = HistoryMinute.objects.get(minute=minute, scope="all", key="")
    assert (row.succeeded, row.failed) == (2, 2)
    assert row.errors == {"vendor": 1, "deadline": 1}
    assert row.wait_p95_s == 3.0
    assert HistoryMinute.objects.get(minute=minute, scope="lane", key="interactive").failed == 1
    assert HistoryMinute.objects.get(minute=minute, scope="channel", key="fallback").succeeded == 1
    assert HistoryMinute.objects.get(minute=minute + timedelta(minutes=1), scope="all").succeeded == 1
    assert HistoryMinute.objects.get(minute=floor_minute(now), scope="all").submitted == 5
    # Recomputing is safe: the same numbers, no second row; a late write is caught up in place.
    history_rollup(now)
    assert HistoryMinute.objects.filter(minute=minute, scope="all").count() == 1
    finish(submit_file(api), "SUCCEEDED", minute + timedelta(seconds=55))
    history_rollup(now)
    assert [row.succeeded for row in HistoryMinute.objects.filter(minute=minute, scope="all")] == [3]
    assert error_class("http_503") == "vendor" and error_class("quarantined") == "input"


def test_a_backfill_reads_each_table_once_a_chunk_not_once_a_minute(api):
    """After a pause the dispatcher fills in up to a day: a statement per minute per table made a
    day's backfill 5,760 reads; chunks of minutes make it a few dozen, with the same numbers."""
    ids = [submit_file(api) for _ in range(3)]
    now = timezone.now()
    early, late = floor_minute(now) - timedelta(minutes=80), floor_minute(now) - timedelta(minutes=3)
    finish(ids[0], "SUCCEEDED", early + timedelta(seconds=10), wait_s=2.0)
    finish(ids[1], "FAILED", early + timedelta(seconds=59), code="shed", lane="batch")
    finish(ids[2], "SUCCEEDED", late + timedelta(seconds=1), channel="fallback")
    with CaptureQueriesContext(connection) as statements:
        written = history_rollup(now, minutes=90)
    reads = [q for q in statements.captured_queries if q["sql"].lstrip().upper().startswith("SELECT")]
    assert len(reads) == 4 * 3  # four tables, three chunks of 30 minutes
    assert HistoryMinute.objects.filter(scope="all").count() == 90 and written >= 90
    row = HistoryMinute.objects.get(minute=early, scope="all")
    assert (row.succeeded, row.failed, row.errors, row.wait_p95_s) == (1, 1, {"capacity": 1}, 2.0)
    assert HistoryMinute.objects.get(minute=early, scope="lane", key="batch").failed == 1
    assert HistoryMinute.objects.get(minute=late, scope="channel", key="fallback").succeeded == 1
    recent = HistoryMinute.objects.filter(scope="all", minute__gte=floor_minute(now) - timedelta(minutes=1))
    assert sum(row.submitted for row in recent) == 3  # in this minute (or the last, had it just turned)


def test_a_busy_minute_does_not_leave_the_others_of_its_chunk_without_a_sample(db, monkeypatch):
    """Durations are sampled per minute (SAMPLE each; 2 here, so that a handful of rows is busy): a
    chunk with more than its share is read a minute at a time, each minute with its own sample."""
    from tasks.models import VendorCall, VendorChannel
    from tasks.services import history

    monkeypatch.setattr(history, "SAMPLE", 2)
    busy = floor_minute(timezone.now()) - timedelta(minutes=2)
    channel = VendorChannel.objects.get(name="primary")
    for second, duration in ((1, 10), (2, 10), (3, 10), (4, 10), (5, 10), (70, 99)):
        call = VendorCall.objects.create(channel=channel, operation="get_job", outcome="ok", duration_ms=duration)
        VendorCall.objects.filter(pk=call.pk).update(at=busy + timedelta(seconds=second))
    rows = history.minute_rows(busy, 2)
    assert rows[busy][("all", "")]["vendor_p50_ms"] == 10.0
    assert rows[busy + timedelta(minutes=1)][("all", "")]["vendor_p50_ms"] == 99.0


def test_rows_past_seven_days_are_dropped(db):
    old = floor_minute(timezone.now() - timedelta(days=8))
    HistoryMinute.objects.create(minute=old, scope="all", key="", succeeded=3)
    history_rollup()
    assert not HistoryMinute.objects.filter(minute=old).exists()


def test_the_dashboard_charts_show_the_rollups_numbers(client, api):
    now = timezone.now()
    ids = [submit_file(api) for _ in range(4)]
    minute = floor_minute(now) - timedelta(minutes=5)
    for index, task_id in enumerate(ids):
        finish(task_id, "SUCCEEDED" if index < 3 else "FAILED", minute + timedelta(seconds=index), code="" if index < 3 else "shed")
    history_rollup(now, minutes=10)
    user, password = staff_ensure(username="viewer-history", role="viewer", actor="test")
    client.login(username=user.username, password=password)
    page = client.get(reverse("admin:index")).content.decode()
    hour = re.search(r'data-chart="throughput-1h".*?</svg>', page, re.S).group(0)
    columns = re.findall(r'data-bucket="([^"]+)" data-succeeded="(\d+)" data-failed="(\d+)"', hour)
    assert len(columns) == 60
    shown = {bucket: (int(ok), int(bad)) for bucket, ok, bad in columns}
    for row in HistoryMinute.objects.filter(scope="all", minute__gte=floor_minute(now) - timedelta(minutes=59)):
        assert shown[row.minute.isoformat()] == (row.succeeded, row.failed)
    assert shown[minute.isoformat()] == (3, 1)
    day = re.search(r'data-chart="throughput-24h".*?</svg>', page, re.S).group(0)
    day_columns = re.findall(r'data-succeeded="(\d+)" data-failed="(\d+)"', day)
    assert 48 <= len(day_columns) <= 49
    assert sum(int(ok) for ok, _ in day_columns) == 3 and sum(int(bad) for _, bad in day_columns) == 1
    assert 'data-class="capacity"' in page
