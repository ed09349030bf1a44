"""How the chaos report measures recovery after a fault, from the tasks' own history."""

from tasks.management.commands.chaos import recovery, recovery_after_s

EVENTS = [
    ("a", "RUNNING", 1.0), ("a", "SUCCEEDED", 12.0),  # held by the cut host: moved on 2 s after the heal
    ("b", "RUNNING", 2.0), ("b", "SUCCEEDED", 6.0),  # taken over during the fault
    ("c", "ACCEPTED", 7.0), ("c", "QUEUED", 13.0),  # accepted while the web host was cut off
    ("d", "RUNNING", 8.0),  # never moved again
]


def test_recovery_is_when_the_last_caught_task_moved_on_counted_from_the_faults_end():
    assert recovery_after_s(10.0, {"a": 5.0, "b": 5.0}, EVENTS) == 2.0
    assert recovery_after_s(10.0, {"b": 5.0}, EVENTS) == 0.0  # all moved during the fault
    assert recovery_after_s(10.0, {}, EVENTS) == 0.0
    assert recovery_after_s(10.0, {"a": 5.0, "d": 9.0}, EVENTS) is None  # d never did: not recovered


def test_a_web_cut_catches_the_tasks_accepted_during_it_a_host_fault_those_it_held():
    web = recovery({"_start": 5.0, "_end": 10.0, "_caught": None}, EVENTS)
    assert web == {"tasks_caught": 1, "recovered_after_s": 3.0}  # c, from its acceptance
    host = recovery({"_start": 5.0, "_end": 10.0, "_caught": ["a", "b"]}, EVENTS)
    assert host == {"tasks_caught": 2, "recovered_after_s": 2.0}
    assert recovery({"kind": "vendor"}, EVENTS) == {}
