"""Three worker processes (separate OS processes, two lanes) against PostgreSQL + Redis, with the
fake vendor counting concurrency: budgets hold, fencing holds when one process is SIGKILLed, and
fairness holds. Runs in the distributed pass of `make test` (DATABASE_URL and REDIS_URL set)."""

from __future__ import annotations

import os
import signal

import pytest
from django.conf import settings
from django.db.models import Min

from tasks.models import Attempt, Lane, Task, TenantQuota, VendorChannel
from tasks.poc import files
from tasks.services.tenancy import tenant_ensure, token_issue
from tests.conftest import TEST_TIME_SCALE, wait_for
from tests.support.flows import submit_file

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.skipif(not (settings.DATABASE_URL and settings.REDIS_URL),
                       reason="the distributed setup: run with DATABASE_URL and REDIS_URL (make test does)"),
]


def client_for(name: str):
    from django.test import Client

    return Client(HTTP_AUTHORIZATION=f"Bearer {token_issue(tenant=tenant_ensure(name=name)).token}")


def test_budgets_fencing_and_fairness_hold_across_three_worker_processes(vendor, tmp_path):
    from tasks.system import Stack

    VendorChannel.objects.filter(name="primary").update(max_inflight_jobs=4, max_concurrent_uploads=2,
                                                        reserved_for_interactive=1)
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    Lane.objects.filter(pk="batch").update(max_running=3)
    Lane.objects.filter(pk="interactive").update(max_running=3)
    vendor.control.channel("primary", processing_ms=4000)
    # Slow uploads, so a worker can be caught (and killed) in the middle of one.
    vendor.control.add_rule({"endpoint": "POST /v1/uploads", "type": "bandwidth", "params": {"bytes_per_s": 300_000}})
    flood, trickle, interactive = client_for("flood"), client_for("trickle"), client_for("people")
    TenantQuota.objects.filter(tenant__name="trickle").update(lane_weights={"batch": 1})

    # INFO: the test waits for each cluster to log that it is running.
    env = {"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05", "SLUICE_Q_LOG_LEVEL": "INFO"}
    stack = Stack(log_dir=tmp_path / "s", env=env)
    try:
        stack.start_dispatcher()
        stack.start_cluster(None, workers=1)
        # Three worker processes over two lanes: two separate batch clusters, one interactive.
        stack.manage("batch-a", "qcluster", extra_env={"Q_CLUSTER_NAME": "batch", "SLUICE_LANE_WORKERS": "batch=1"})
        stack.manage("batch-b", "qcluster", extra_env={"Q_CLUSTER_NAME": "batch", "SLUICE_LANE_WORKERS": "batch=1"})
        stack.manage("interactive", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        for name in ("batch-a", "batch-b", "interactive"):
            stack.wait_logged(name, "] running.")
        # The batch lane is held while both tenants submit, so the order of dispatch is fair
        # share's choice and not a race between submission speed and the workers.
        Lane.objects.filter(pk="batch").update(paused=True)
        flood_ids = [submit_file(flood, files.wav(20), priority="batch") for _ in range(12)]
        trickle_ids = [submit_file(trickle, files.wav(20), priority="batch") for _ in range(3)]
        wait_for(lambda: Task.objects.filter(pk__in=flood_ids + trickle_ids, state="QUEUED").count() == 15, timeout=60,
                 message="the batch tasks to be pre-checked and queued")
        Lane.objects.filter(pk="batch").update(paused=False)
        people_ids = [submit_file(interactive, files.wav(2)) for _ in range(3)]

        # Kill a worker process that is in the middle of a flood task's upload. A killed task holds
        # its slot, and counts as its tenant's running task, until it is fenced and reconciled: the trickle's
        # would keep the trickle at its fair share, and behind the flood, for that whole time.
        def uploading():
            return Task.objects.filter(pk__in=flood_ids, state="RUNNING", phase="upload").exclude(lease_owner="").first()

        victim = wait_for(uploading, timeout=60, message="a worker in the middle of an upload")
        pid = int(victim.lease_owner.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)

        every = flood_ids + trickle_ids + people_ids
        wait_for(lambda: Task.objects.filter(pk__in=every, state="SUCCEEDED").count() == len(every), timeout=240,
                 message="every task to succeed")
    finally:
        stack.stop_all()

    seen = vendor.control.invariants()
    assert seen["max_concurrent_jobs_by_channel"]["primary"] <= 4, seen
    assert seen["max_concurrent_uploads_by_channel"]["primary"] <= 2, seen
    assert seen["duplicate_billed_client_refs"] == [] and seen["billed_jobs"] == len(every)
    # Fencing: the killed attempt was fenced and never wrote after its generation moved on.
    fenced = Attempt.objects.get(task_id=victim.pk, generation=victim.generation)
    assert fenced.outcome == "fenced"
    killed = Task.objects.get(pk=victim.pk)
    assert killed.state == "SUCCEEDED" and killed.generation > victim.generation
    assert any("lease of" in e.reason for e in killed.events.all())
    # Fairness: the trickle's three tasks, queued behind the whole flood, were not kept waiting for
    # it to drain (first come, first served would have started, and finished, every flood task
    # first). Fair share decides who starts: judged by each task's first start. Finishing order
    # adds the uploads' speeds and the killed task's wait for its lease, so it is held to less.
    def order(field):
        when = {str(t.pk): getattr(t, field) for t in Task.objects.filter(pk__in=flood_ids + trickle_ids)
                .annotate(first_start=Min("attempt_rows__started_at"))}
        trickle = set(map(str, trickle_ids))
        return [("trickle" if pk in trickle else "flood") for pk in sorted(when, key=when.get)]

    started, finished = order("first_start"), order("finished_at")
    assert started[-5:] == ["flood"] * 5 and started.index("trickle") < 3, f"the order of first starts: {started}"
    assert finished[-3:] == ["flood"] * 3, f"the order of finishes: {finished}"
