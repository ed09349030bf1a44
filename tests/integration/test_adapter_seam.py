"""The steps' decisions through the adapter seam, against an in-memory vendor (no HTTP): what each
capability set lets Sluice do after an ambiguous create, and what it must not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from django.conf import settings

from tasks.models import Task, VendorChannel
from tasks.services.execution.reconcile import operator_decides
from tasks.vendors.memory import CAPABILITIES, MemoryVendor, lost_answer, not_processed
from tests.conftest import run_until
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def memory(monkeypatch, transactional_db, settings):
    """The primary channel speaks to an in-memory vendor; queue messages run in this process."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", True)
    settings.TIME_SCALE = 0.05
    VendorChannel.objects.filter(name__in=["fallback", "local"]).update(enabled=False)
    VendorChannel.objects.filter(name="primary").update(dialect="memory")
    yield
    MemoryVendor.vendors.clear()


def test_a_lost_create_answer_is_reconciled_and_the_job_adopted(memory, api):
    vendor = MemoryVendor.for_channel("primary")
    vendor.script("create_job", lost_answer())
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and vendor.billed() == 1
    assert vendor.calls.count("create_job") == 1 and "find_jobs" in vendor.calls


def test_an_unsearchable_vendor_holds_the_task_and_a_key_makes_the_operators_resend_safe(memory, api):
    """reconcile_by none, idempotency key honoured: the operator's resend is replayed by the vendor."""
    vendor = MemoryVendor.for_channel("primary", capabilities=replace(CAPABILITIES, reconcile_by="none"))
    vendor.script("create_job", lost_answer())
    task = run_until(submit_file(api), states=("RECONCILING",))
    from tasks.services.dispatch import tick

    for _ in range(5):
        tick()
    task = Task.objects.get(pk=task.pk)
    assert task.waiting_reason == "needs_operator" and "find_jobs" not in vendor.calls
    assert vendor.calls.count("create_job") == 1
    assert operator_decides(task, decision="not_created", actor_name="olga")
    task = run_until(task.pk)
    assert task.state == "SUCCEEDED" and vendor.billed() == 1, "the vendor replayed the key"


def test_a_vendor_without_keys_or_search_bills_twice_when_the_operator_accepts_it(memory, api):
    vendor = MemoryVendor.for_channel("primary", capabilities=replace(CAPABILITIES, reconcile_by="none",
                                                                       idempotency_key=False))
    vendor.script("create_job", lost_answer())
    task = run_until(submit_file(api), states=("RECONCILING",))
    assert operator_decides(Task.objects.get(pk=task.pk), decision="resend", actor_name="olga")
    task = run_until(task.pk)
    assert task.state == "SUCCEEDED" and vendor.billed() == 2


def test_an_operator_decision_is_refused_for_a_task_that_is_not_waiting_for_one(memory, api):
    MemoryVendor.for_channel("primary")
    task = run_until(submit_file(api))
    assert not operator_decides(task, decision="resend", actor_name="olga")
    with pytest.raises(ValueError):
        operator_decides(task, decision="shrug", actor_name="olga")


def test_a_vendor_that_cannot_stop_a_job_is_waited_for_before_a_cancel_is_confirmed(memory, api):
    from tasks.services.cancel import task_cancel

    vendor = MemoryVendor.for_channel("primary", capabilities=replace(CAPABILITIES, cancel=False), polls_to_complete=3)
    task_id = submit_file(api)
    run_until(task_id, states=("RUNNING",))
    task_cancel(task_id=task_id, actor="user", reason="changed my mind")
    run_until(task_id, states=("CANCELLED",))
    (job,) = vendor.jobs.values()
    assert job["view"].status == "completed", "the job ran to its end: it could not be stopped"
    assert "cancel_job" in vendor.calls, "its data was dropped once it had ended"


def test_not_processed_answers_are_retried_with_the_same_key(memory, api):
    vendor = MemoryVendor.for_channel("primary")
    vendor.script("upload", not_processed(503), not_processed(429))
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED" and vendor.calls.count("upload") == 3 and vendor.billed() == 1


def test_no_module_outside_the_vendors_package_speaks_http_to_vendors():
    """httpx is imported only by the vendor adapters, and by code that talks to other things."""
    allowed = {
        "tasks/services/notifications.py": "tenant callbacks",
        "tasks/poc/context.py": "the POC drives Sluice's own API",
        "tasks/system.py": "health checks of processes it starts",
        "tasks/bench/suite.py": "the benchmark drives Sluice's API",
    }
    base = Path(settings.BASE_DIR)
    importing = {
        str(path.relative_to(base)) for folder in ("tasks", "console") for path in (base / folder).rglob("*.py")
        if "import httpx" in path.read_text() or "from httpx" in path.read_text()
    }
    assert {p for p in importing if not p.startswith("tasks/vendors/")} <= set(allowed)
    assert not (base / "tasks" / "vendor").exists()
