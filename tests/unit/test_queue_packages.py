"""A step's message is the package django-q2's async_task builds, signed as it signs: a cluster
reads it with django-q2's own SignedPackage.loads (tasks/queueing.py `_package`)."""

from __future__ import annotations

import re
from datetime import datetime

from django_q.signals import pre_enqueue
from django_q.signing import SignedPackage
from django_q.tasks import async_task

from tasks.queueing import _Collected, _package


def packaged(**options) -> dict:
    collected = _Collected("batch")
    _package("tasks.workers.run_step", ("precheck", "a-task", 3), cluster="batch", broker=collected, **options)
    assert len(collected.packages) == 1
    return SignedPackage.loads(collected.packages[0])


def by_async_task(**options) -> dict:
    collected = _Collected("batch")
    async_task("tasks.workers.run_step", "precheck", "a-task", 3, cluster="batch", broker=collected, **options)
    return SignedPackage.loads(collected.packages[0])


def test_a_message_reads_back_as_the_package_async_task_builds():
    ours = packaged(name="precheck a-task", timeout=40)
    theirs = by_async_task(task_name="precheck a-task", timeout=40)
    assert re.fullmatch(r"[0-9a-f]{32}", ours["id"]) and ours["id"] != theirs["id"]
    assert isinstance(ours["started"], datetime) and ours["started"].utcoffset() is not None
    assert {k: v for k, v in ours.items() if k not in ("id", "started")} == \
        {k: v for k, v in theirs.items() if k not in ("id", "started")}
    assert ours["args"] == ("precheck", "a-task", 3) and ours["timeout"] == 40 and ours["cluster"] == "batch"


def test_without_a_timeout_or_a_name_the_package_has_none_and_is_named_after_its_function():
    ours = packaged(name="", timeout=None)
    assert "timeout" not in ours and ours["name"] == "tasks.workers.run_step"
    assert set(ours) == set(by_async_task(task_name="tasks.workers.run_step"))


def test_a_pre_enqueue_listener_still_hears_every_message():
    heard = []

    def listener(sender, task, **kwargs):
        heard.append(task["args"])

    pre_enqueue.connect(listener)
    try:
        packaged(name="precheck a-task", timeout=40)
    finally:
        pre_enqueue.disconnect(listener)
    assert heard == [("precheck", "a-task", 3)]
