"""The circuit breaker is shared by every worker process; fallback and recovery lose nothing."""

import pytest
from django.utils import timezone

from tasks.models import Attempt, BreakerTransition, ChannelHealth, Task, VendorChannel
from tasks.vendors.errors import BreakerOpen
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
    # INFO: the test waits for each cluster to log that it is running.
    env = {"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05", "SLUICE_Q_LOG_LEVEL": "INFO"}
    stack = Stack(log_dir=tmp_path / "s", env=env)
    try:
        stack.start_dispatcher()
        stack.start_cluster(None)
        # Two separate worker processes of the same lane share one breaker through the database.
        stack.manage("interactive-a", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        stack.manage("interactive-b", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        # Both are running before the first task, or on a loaded machine one may take every call
        # to the primary before the other has started (nothing shared would then be shown).
        for name in ("interactive-a", "interactive-b"):
            stack.wait_logged(name, "] running.")
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


def test_a_trial_permit_taken_long_after_the_breaker_half_opened_is_not_counted_lost(transactional_db):
    """A half-open breaker may wait a long time for traffic between its trial calls (a probe
    takes one permit; the next waits for a task). A trial that has just taken the last permit is
    running, not lost: 'long ago' counts from the last permit taken, not from the half-open move
    (the POC vendor-outage-fallback saw its breaker reopened under a trial that then succeeded)."""
    from datetime import timedelta

    from tasks import timescale
    from tasks.vendors import breaker
    from tasks.vendors.policies import BreakerPolicy

    VendorChannel.objects.filter(name="primary").update(breaker_open_wait_s=30, breaker_half_open_calls=2)
    channel = VendorChannel.objects.get(pk="primary")
    policy = BreakerPolicy.for_channel(channel)
    breaker._cas(breaker.health_for(channel), "CLOSED", "OPEN", opened_at=timezone.now() - timescale.delta(31))
    breaker.acquire(channel)  # half-opens the breaker and takes the first permit
    # ... which was long ago: the first trial reported nothing yet, and traffic comes back only now.
    ChannelHealth.objects.filter(pk="primary").update(updated_at=timezone.now() - timescale.delta(300) - timedelta(seconds=1))
    breaker.acquire(channel)  # the last permit, taken now
    health = ChannelHealth.objects.get(pk="primary")
    assert health.breaker_state == "HALF_OPEN" and health.half_open_permits_used == 2
    assert not breaker.trials_lost(health, policy)
    assert not breaker.reopen_if_trials_lost(channel, health)
    # Once the last permit has gone unanswered past the bound, the trials are lost.
    later = timezone.now() + timescale.delta(max(policy.open_wait_s, policy.slow_call_s)) + timedelta(seconds=1)
    assert breaker.trials_lost(health, policy, now=later)


def test_a_half_open_breaker_whose_trial_calls_died_with_their_worker_opens_again_and_recovers(inline_queue, api):
    """A half-open breaker admits a few trial calls and decides on their outcomes. A worker that is
    killed, or cut off from the database, during its trial never reports it: every permit is taken
    and no verdict ever comes. The breaker must not stay half-open for ever (the chaos run found
    tasks parked behind one until its deadline): it opens again, and a new trial closes it."""
    from tasks import timescale
    from tasks.vendors import breaker
    from tests.conftest import run_until

    VendorChannel.objects.filter(name="primary").update(breaker_open_wait_s=30, breaker_half_open_calls=2)
    VendorChannel.objects.filter(name="fallback").update(enabled=False)  # nowhere else to go
    channel = VendorChannel.objects.get(pk="primary")
    health = breaker.health_for(channel)
    breaker._cas(health, "CLOSED", "OPEN", opened_at=timezone.now() - timescale.delta(31))
    # Two workers take the trial permits (the first half-opens the breaker)... and die.
    breaker.acquire(channel)
    breaker.acquire(channel)
    assert ChannelHealth.objects.get(pk="primary").breaker_state == "HALF_OPEN"
    with pytest.raises(BreakerOpen):
        breaker.acquire(channel)
    task = run_until(submit_file(api), timeout=30)
    assert task.state == "SUCCEEDED" and task.channel_id == "primary", (task.state, task.error_code)
    moves = list(BreakerTransition.objects.filter(channel_id="primary").order_by("id").values_list("from_state", "to_state"))
    assert ("HALF_OPEN", "OPEN") in moves and moves[-1] == ("HALF_OPEN", "CLOSED"), moves


def test_the_health_admission_reads_with_the_channels_serves_the_calls_after_it(transactional_db):
    """Admission reads every channel's health with the channels (channel_rooms): a call right after
    it in the same process takes its permit from that read instead of reading the row again, and
    a breaker that read found open is not hidden by an older closed one this process kept."""
    from django.db import connection
    from django.db.models import F
    from django.test.utils import CaptureQueriesContext

    from tasks.scheduling.channels import channel_rooms
    from tasks.vendors import breaker

    channel = VendorChannel.objects.get(pk="primary")
    breaker.health_for(channel)  # its row exists, as after any call
    breaker._forget(channel.pk)
    with CaptureQueriesContext(connection) as statements:
        rooms = channel_rooms()
        permit = breaker.acquire(channel)
    assert rooms["primary"].available and not permit.trial
    assert len(statements.captured_queries) == 1, [q["sql"] for q in statements.captured_queries]
    # Another process opens the breaker; the next admission reads it open, and so does the next call
    # (without the admission's read noted, the closed state read a moment ago would still serve it).
    ChannelHealth.objects.filter(pk="primary").update(breaker_state="OPEN", opened_at=timezone.now(),
                                                      breaker_version=F("breaker_version") + 1)
    assert not channel_rooms()["primary"].available
    with pytest.raises(BreakerOpen):
        breaker.acquire(channel)
