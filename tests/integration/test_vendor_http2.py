"""Sluice's vendor client over HTTP/2 (a channel's `http2`): against the fake vendor's h2c, a task
runs end to end over HTTP/2; a GOAWAY that refuses a poll (provably not processed) is resent by
itself, and one that cuts off a create after it may have been processed is reconciled, never
billed twice."""

from __future__ import annotations

import pytest

from tasks.models import VendorChannel, VendorJob
from tests.conftest import run_until
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def http2_primary_only():
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    VendorChannel.objects.filter(name="primary").update(http2=True)


def test_a_task_runs_end_to_end_over_http2(inline_queue, api):
    http2_primary_only()
    task = run_until(submit_file(api), timeout=60)
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    protocols = {e["protocol"] for e in inline_queue.control.journal() if e["endpoint"].startswith(("POST /v1", "GET /v1"))}
    assert protocols == {"HTTP/2"}


def test_a_goaway_on_polls_is_resent_and_a_goaway_after_a_create_is_reconciled(inline_queue, api):
    http2_primary_only()
    control = inline_queue.control
    control.add_rule({"endpoint": "GET /v1/jobs/*", "type": "goaway", "times": 2})
    control.add_rule({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "goaway"}, "times": 1})
    task = run_until(submit_file(api), timeout=90)
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    journal = control.journal()
    assert [e["outcome"] for e in journal if e["endpoint"] == "POST /v1/jobs"][0] == "response_lost:goaway"
    assert "goaway" in [e["outcome"] for e in journal if e["endpoint"] == "GET /v1/jobs/*"]
    assert len([e for e in control.ledger() if (e["client_ref"] or "").startswith(str(task.pk))]) == 1
    assert VendorJob.objects.filter(task=task).count() == 1
