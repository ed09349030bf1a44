"""Group commit: which calls share a transaction, and who hears what. Real threads, no database:
`run` records the groups it is given; the first one is held open until the test lets it go."""

from __future__ import annotations

import threading
import time

import pytest

from tasks.groupcommit import GroupCommit


class Recorder:
    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.first_may_finish = threading.Event()
        self.fail_on: str | None = None

    def run(self, context: str, items: list[str]) -> list[str]:
        self.groups.append(list(items))
        if len(self.groups) == 1:
            assert self.first_may_finish.wait(10)
        if self.fail_on in items:
            raise RuntimeError("the database went away")
        return [f"{context}:{item}" for item in items]


def call_in_thread(commit: GroupCommit, answers: dict, key: str, item: str, **kwargs) -> threading.Thread:
    def target() -> None:
        try:
            answers[item] = commit.call(key, f"ctx-{item}", item, **kwargs)
        except RuntimeError as error:
            answers[item] = error

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def wait_until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_call_with_nothing_running_runs_at_once_alone():
    recorder = Recorder()
    recorder.first_may_finish.set()
    commit = GroupCommit(recorder.run, max_items=10)
    assert commit.call("tenant", "ctx", "a") == "ctx:a"
    assert commit.call("tenant", "ctx", "b") == "ctx:b"
    assert recorder.groups == [["a"], ["b"]]


def test_calls_arriving_while_one_runs_share_the_next_transaction_and_each_hears_its_own_answer():
    recorder = Recorder()
    commit = GroupCommit(recorder.run, max_items=10)
    answers: dict = {}
    threads = [call_in_thread(commit, answers, "tenant", "first")]
    wait_until(lambda: len(recorder.groups) == 1)
    for item in ("b", "c", "d"):
        threads.append(call_in_thread(commit, answers, "tenant", item))
        wait_until(lambda: commit.waiting("tenant") == ["b", "c", "d"].index(item) + 1)
    # Another key's call is not held behind them.
    other = call_in_thread(commit, answers, "other tenant", "x")
    recorder.first_may_finish.set()
    for thread in [*threads, other]:
        thread.join(10)
    assert recorder.groups[0] == ["first"] and ["b", "c", "d"] in recorder.groups and ["x"] in recorder.groups
    # The group ran with its leader's context (the first to wait); each caller got its own item's answer.
    assert answers == {"first": "ctx-first:first", "b": "ctx-b:b", "c": "ctx-b:c", "d": "ctx-b:d", "x": "ctx-x:x"}
    assert (commit.groups_run, commit.items_run) == (3, 5)


def test_a_full_group_leaves_the_next_arrivals_to_the_group_after_it():
    recorder = Recorder()
    commit = GroupCommit(recorder.run, max_items=2)
    answers: dict = {}
    threads = [call_in_thread(commit, answers, "tenant", "first")]
    wait_until(lambda: len(recorder.groups) == 1)
    for item, waiting in (("b", 1), ("c", 2)):
        threads.append(call_in_thread(commit, answers, "tenant", item))
        wait_until(lambda: commit.waiting("tenant") == waiting)
    threads.append(call_in_thread(commit, answers, "tenant", "d"))
    time.sleep(0.05)
    assert commit.waiting("tenant") == 2
    recorder.first_may_finish.set()
    for thread in threads:
        thread.join(10)
    assert recorder.groups == [["first"], ["b", "c"], ["d"]]
    assert answers["d"] == "ctx-d:d"


def test_an_item_whose_key_is_running_or_waiting_runs_beside_them_at_once():
    """Two submissions with one Idempotency-Key never share a transaction, and the second does
    not wait here for the first: it meets the first's key on its own (409 or a replay)."""
    recorder = Recorder()
    commit = GroupCommit(recorder.run, max_items=10)
    answers: dict = {}
    first = call_in_thread(commit, answers, "tenant", "first", exclusive="key-1")
    wait_until(lambda: len(recorder.groups) == 1)
    waiting = call_in_thread(commit, answers, "tenant", "b", exclusive="key-2")
    wait_until(lambda: commit.waiting("tenant") == 1)
    assert commit.call("tenant", "ctx", "again-1", exclusive="key-1") == "ctx:again-1"
    assert commit.call("tenant", "ctx", "again-2", exclusive="key-2") == "ctx:again-2"
    assert "b" not in answers and commit.waiting("tenant") == 1
    recorder.first_may_finish.set()
    first.join(10)
    waiting.join(10)
    assert recorder.groups == [["first"], ["again-1"], ["again-2"], ["b"]]


def test_a_transaction_that_fails_fails_every_caller_in_it_and_no_other():
    recorder = Recorder()
    recorder.fail_on = "c"
    commit = GroupCommit(recorder.run, max_items=10)
    answers: dict = {}
    threads = [call_in_thread(commit, answers, "tenant", "first")]
    wait_until(lambda: len(recorder.groups) == 1)
    for index, item in enumerate(("b", "c")):
        threads.append(call_in_thread(commit, answers, "tenant", item))
        wait_until(lambda: commit.waiting("tenant") == index + 1)
    recorder.first_may_finish.set()
    for thread in threads:
        thread.join(10)
    assert answers["first"] == "ctx-first:first"
    assert isinstance(answers["b"], RuntimeError) and isinstance(answers["c"], RuntimeError)
    # Nothing is left behind: the next call runs at once.
    assert commit.call("tenant", "ctx", "e") == "ctx:e"


@pytest.mark.parametrize("callers", [16])
def test_many_callers_at_once_all_hear_their_own_answer(callers):
    """No arrival order loses or mixes up an answer."""
    seen: list[list[str]] = []

    def run(context: str, items: list[str]) -> list[str]:
        seen.append(items)
        time.sleep(0.002)
        return [item.upper() for item in items]

    commit = GroupCommit(run, max_items=5)
    answers: dict = {}
    threads = []
    for index in range(callers * 10):
        threads.append(call_in_thread(commit, answers, f"t{index % 2}", f"item-{index}"))
    for thread in threads:
        thread.join(10)
    assert answers == {f"item-{index}": f"ITEM-{index}" for index in range(callers * 10)}
    assert sorted(item for group in seen for item in group) == sorted(answers)
    assert all(len(group) <= 5 for group in seen)
