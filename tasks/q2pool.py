"""django-q2's worker pool, hardened against losing an idle worker.

A django-q2 worker waits for work in `multiprocessing.Queue.get()`, which blocks while holding the
queue's cross-process read lock. A worker killed while it waits (the OOM killer, a `kill -9`)
dies holding that lock, and every other worker of the cluster, the reincarnated ones included,
then waits for it forever: the lane silently stops (django-q2 issue #23). Sluice's workers wait
for the queue's pipe to become readable without the lock, then take a message without blocking,
so the lock is held only for the instant a message is taken.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

IDLE_WAIT_S = 1.0
CONTENDED_PAUSE_S = 0.005


class NonBlockingReads:
    """A worker's view of its cluster's task queue that never waits while holding the read lock."""

    def __init__(self, task_queue: Any) -> None:
        self._queue = task_queue

    def get(self) -> Any:
        # Wait for the pipe to be readable, holding nothing: it wakes as soon as a message arrives.
        # Several idle workers may wake; one takes the message. One that finds a message but not
        # the lock (another reader is taking it) pauses briefly instead of spinning.
        readable = getattr(self._queue, "_poll", None)
        pending = False
        while True:
            try:
                return self._queue.get(block=False)
            except queue.Empty:
                if pending or readable is None:
                    time.sleep(CONTENDED_PAUSE_S)
                pending = readable is not None and readable(IDLE_WAIT_S)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def worker(task_queue: Any, *args: Any, **kwargs: Any) -> None:
    from django_q.worker import worker as q2_worker

    q2_worker(NonBlockingReads(task_queue), *args, **kwargs)


def monitor(result_queue: Any, *args: Any, **kwargs: Any) -> None:
    """The cluster's monitor reads the result queue the same way (it too is reincarnated if killed)."""
    from django_q.monitor import monitor as q2_monitor

    q2_monitor(NonBlockingReads(result_queue), *args, **kwargs)


def lane_priority() -> None:
    """A lane's cluster runs at its lane's CPU priority (settings.LANE_NICE); its sentinel,
    pusher, monitor and workers inherit it."""
    from django.conf import settings

    lane = os.environ.get("Q_CLUSTER_NAME")
    increment = settings.LANE_NICE.get(lane, 0) if lane else 0
    if increment > 0:
        os.nice(increment)


def install() -> None:
    """Have django-q2's sentinel spawn (and recognise) Sluice's worker and monitor. Idempotent.

    SLUICE_Q2_STOCK_WORKERS=1 keeps django-q2's own worker: the benchmark's "raw django-q2"
    reference runs stock django-q2, nothing of Sluice's."""
    if os.environ.get("SLUICE_Q2_STOCK_WORKERS") == "1":
        return
    import django_q.cluster

    django_q.cluster.worker = worker
    django_q.cluster.monitor = monitor
