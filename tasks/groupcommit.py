"""Group commit: concurrent calls of one process that would each open a write transaction share one.

A web process answers several submissions at once (gunicorn's threads). Each one alone pays a
write transaction: its begin, its reads of the lane and the keys, its INSERTs, its commit and the
commit's flush. While one group's transaction runs, the calls that arrive for the same group key
wait together, and the first of them (the leader) then runs them all in one transaction, as a
batch request would be; each caller gets its own item's answer. A call that finds no transaction
of its key running runs at once, alone: nothing waits for a group that is not needed, and a quiet
system answers as fast as before.

Nothing is answered before its group commits: every caller is durable before its answer, as it
would be alone. A failure of the whole transaction (the database gone) is every caller's failure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")


@dataclass
class _Group(Generic[Item, Outcome]):
    context: Any
    items: list[Item] = field(default_factory=list)
    exclusive: set[Hashable] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] | None = None
    error: BaseException | None = None


class GroupCommit(Generic[Item, Outcome]):
    """`run(context, items)` answers a list of items in one transaction, an outcome per item in their
    order; `context` is the leader's (every caller of one group key must be able to stand for the
    others: the same tenant and actor)."""

    def __init__(self, run: Callable[[Any, list[Item]], list[Outcome]], *, max_items: int) -> None:
        self._run = run
        self._max = max_items
        self._lock = threading.Lock()
        self._forming: dict[Hashable, _Group] = {}  # the next group of a key, open to joiners
        self._running: dict[Hashable, _Group] = {}  # the group of a key whose transaction runs now
        self.groups_run = 0  # how many transactions ran, and for how many items (for tests and measures)
        self.items_run = 0

    def call(self, key: Hashable, context: Any, item: Item, *, exclusive: Hashable | None = None) -> Outcome:
        """`item`'s outcome, once its transaction has committed. An item whose `exclusive` value
        (an Idempotency-Key) is in the group running or forming now runs at once in a transaction
        of its own, beside them, as it would have without grouping: two items with one value
        never share a transaction, and neither waits for the other here."""
        while True:
            with self._lock:
                running = self._running.get(key)
                forming = self._forming.get(key)
                if exclusive is not None and any(exclusive in g.exclusive for g in (running, forming) if g):
                    alone = True
                    break
                alone = False
                if running is None and forming is None:
                    group = self._running[key] = _Group(context)  # nothing to wait for: run at once
                    _add(group, item, exclusive)
                    break
                if forming is not None and len(forming.items) >= self._max:
                    full = forming
                else:
                    full = None
                    leader = forming is None
                    if leader:
                        forming = self._forming[key] = _Group(context)
                    index = _add(forming, item, exclusive)
            if full is not None:
                full.done.wait()  # the next group is full: wait for it to run, then join the one after
                continue
            if not leader:
                return _answer(forming, index)
            running.done.wait()
            with self._lock:
                # Closed to joiners from here: the next arrivals form the next group.
                group = self._forming.pop(key)
                self._running[key] = group
            break
        if alone:
            return self._run(context, [item])[0]
        try:
            group.outcomes = self._run(group.context, group.items)
        except BaseException as error:
            group.error = error
            raise
        finally:
            with self._lock:
                self.groups_run += 1
                self.items_run += len(group.items)
                if self._running.get(key) is group:
                    del self._running[key]
            group.done.set()
        return group.outcomes[0]

    def waiting(self, key: Hashable) -> int:
        """Items waiting in the next group of `key` for the running one to finish."""
        with self._lock:
            forming = self._forming.get(key)
            return len(forming.items) if forming else 0


def _add(group: _Group, item: Any, exclusive: Hashable | None) -> int:
    group.items.append(item)
    if exclusive is not None:
        group.exclusive.add(exclusive)
    return len(group.items) - 1


def _answer(group: _Group, index: int) -> Any:
    group.done.wait()
    if group.error is not None:
        raise group.error
    assert group.outcomes is not None
    return group.outcomes[index]
