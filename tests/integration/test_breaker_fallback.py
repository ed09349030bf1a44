"""The circuit breaker is shared by every worker process; fallback and recovery lose nothing."""

import pytest

from tasks.models import Attempt, BreakerTransition, ChannelHealth, Task, VendorChannel
from tests.conftest import TEST_TIME_SCALE, wait_for
from tests.support.flows import submit_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_an_outage_opens_the_shared_breaker_moves_work_to_the_fallback_and_recovery_closes_it(vendor, api, tmp_path):
    from tasks.system import Stack

    VendorChannel.objects.filter(name="primary").update(
        breaker_window=10, breaker_minimum_calls=4, breaker_failure_rate=0.5, breaker_open_wait_s=40,
        breaker_half_open_calls=2, max_attempts=50, retry_base_s=2, retry_cap_s=4,
    )
    outage = vendor.control.add_rule({"endpoint": "* *", "match": {"channel": "primary"}, "type": "http_error",
                                      "params": {"status": 503, "code": "unavailable"}})
    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05"})
    try:
        stack.start_dispatcher()
        stack.start_cluster(None)
        # Two separate worker processes of the same lane share one breaker through the database.
        stack.manage("interactive-a", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        stack.manage("interactive-b", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        ids = [submit_file(api) for _ in range(8)]
        wait_for(lambda: all(Task.objects.get(pk=i).state == "SUCCEEDED" for i in ids), timeout=90,
                 message="every task to succeed despite the outage")
        opened = BreakerTransition.objects.filter(channel_id="primary", to_state="OPEN")
        assert opened.exists(), "the breaker never opened"
        assert {t.channel_id for t in Task.objects.filter(pk__in=ids)} == {"fallback"}
        assert Attempt.objects.filter(task_id__in=ids, channel_id="primary").values("pid").distinct().count() >= 2
        # Recovery: the vendor answers again; a probe half-opens the breaker and trials close it.
        vendor.control.delete_rule(outage["id"])
        wait_for(lambda: ChannelHealth.objects.get(pk="primary").breaker_state == "CLOSED", timeout=60,
                 message="the breaker to close after recovery")
        assert BreakerTransition.objects.filter(channel_id="primary", from_state="HALF_OPEN", to_state="CLOSED").exists()
        later = submit_file(api)
        wait_for(lambda: Task.objects.get(pk=later).state == "SUCCEEDED", timeout=60, message="a task after recovery")
        assert Task.objects.get(pk=later).channel_id == "primary"
    finally:
        stack.stop_all()
    invariants = vendor.control.invariants()
    assert invariants["duplicate_billed_client_refs"] == []
    assert invariants["billed_jobs"] == 9
