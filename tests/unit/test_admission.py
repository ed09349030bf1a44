"""Admission decisions as pure values: who gets the next slot, and whether a lane takes new work."""

from tasks.scheduling.admission import AdmissionPolicy, Head, LaneLoad, Share, admission_gate

POLICY = AdmissionPolicy(aging_s=120, urgency_s=60)


def test_fair_share_picks_the_tenant_with_the_fewest_running_per_weight():
    heads = {"a": Head(waited_s=10, deadline_in_s=3600), "b": Head(waited_s=5, deadline_in_s=3600)}
    assert POLICY.next_tenant(heads, {"a": Share(3, 1), "b": Share(1, 1)}) == "b"
    assert POLICY.next_tenant(heads, {"a": Share(3, 4), "b": Share(1, 1)}) == "a"


def test_an_aged_flood_at_its_share_is_not_lifted_over_a_newcomer():
    heads = {"flood": Head(waited_s=500, deadline_in_s=3600), "new": Head(waited_s=1, deadline_in_s=3600)}
    assert POLICY.next_tenant(heads, {"flood": Share(20, 1), "new": Share(0, 1)}) == "new"


def test_aging_lifts_a_tenant_below_its_share_whatever_its_weight():
    heads = {"big": Head(waited_s=5, deadline_in_s=3600), "tiny": Head(waited_s=121, deadline_in_s=3600)}
    shares = {"big": Share(10, 1), "tiny": Share(0, 0.01)}
    assert POLICY.next_tenant(heads, shares) == "tiny"
    assert POLICY.next_tenant({**heads, "tiny": Head(waited_s=100, deadline_in_s=3600)}, shares) == "big"


def test_a_head_near_its_deadline_goes_first_earliest_deadline_first():
    heads = {"a": Head(waited_s=1, deadline_in_s=50), "b": Head(waited_s=1, deadline_in_s=30),
             "c": Head(waited_s=999, deadline_in_s=3600)}
    assert POLICY.next_tenant(heads, {"a": Share(9, 1), "b": Share(9, 1), "c": Share(0, 1)}) == "b"


def test_a_tenant_at_its_quota_is_skipped_and_none_when_all_are():
    heads = {"a": Head(waited_s=1, deadline_in_s=10), "b": Head(waited_s=1, deadline_in_s=3600)}
    assert POLICY.next_tenant(heads, {"a": Share(1, 1, at_quota=True), "b": Share(5, 1)}) == "b"
    assert POLICY.next_tenant(heads, {"a": Share(1, 1, True), "b": Share(5, 1, True)}) is None


def test_an_arrival_takes_a_free_slot_at_once_only_where_a_pass_would_pick_it():
    """Incremental admission agrees with a pass: alone in the lane, a task not at its quota is
    the pass's pick; with others waiting (or no slot free) it waits for the pass."""
    alone = {"t": Head(waited_s=0, deadline_in_s=3600)}
    for at_quota in (False, True):
        picked = POLICY.next_tenant(alone, {"t": Share(3, 1, at_quota=at_quota)}) == "t"
        assert AdmissionPolicy.admits_on_arrival(waiting=0, free=1, at_quota=at_quota) is picked
    assert not AdmissionPolicy.admits_on_arrival(waiting=1, free=5, at_quota=False)
    assert not AdmissionPolicy.admits_on_arrival(waiting=0, free=0, at_quota=False)


def gate(**load):
    return admission_gate(max_queued=10, max_running=4, early_close_pct=80, oldest_wait_limit_s=150, busy_close_pct=0,
                          load=LaneLoad(**{"waiting": 0, "running": 0, "oldest_wait_s": 0.0, **load}))


def test_the_gate_closes_at_the_early_close_threshold_and_is_full_at_the_limit():
    assert gate(waiting=7).state == "open"
    assert gate(waiting=8).state == "closing" and "80%" in gate(waiting=8).reason
    assert gate(waiting=10).state == "full"


def test_the_gate_closes_while_the_oldest_task_has_waited_too_long():
    assert gate(waiting=1, oldest_wait_s=151).state == "closing"
    assert gate(waiting=1, oldest_wait_s=149).state == "open"


def test_the_active_worker_gate_closes_only_when_on_and_work_waits():
    busy = dict(max_queued=10, max_running=4, early_close_pct=100, oldest_wait_limit_s=None)
    assert admission_gate(**busy, busy_close_pct=100, load=LaneLoad(waiting=1, running=4, oldest_wait_s=0)).state == "closing"
    assert admission_gate(**busy, busy_close_pct=100, load=LaneLoad(waiting=0, running=4, oldest_wait_s=0)).state == "open"
    assert admission_gate(**busy, busy_close_pct=0, load=LaneLoad(waiting=3, running=4, oldest_wait_s=0)).state == "open"
