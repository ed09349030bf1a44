"""django-q2's worker pool, hardened against losing an idle worker and against stopping forever.

A django-q2 worker waits for work in `multiprocessing.Queue.get()`, which blocks while holding the
queue's cross-process read lock. A worker killed while it waits (the OOM killer, a `kill -9`)
dies holding that lock, and every other worker of the cluster, the reincarnated ones included,
then waits for it forever: the lane silently stops (django-q2 issue #23). Sluice's workers wait
for the queue's pipe to become readable without the lock, then take a message without blocking,
so the lock is held only for the instant a message is taken.

Stopping has the same family of problem: the cluster's main process sets a cross-process Event
when it is told to stop, and a child killed while it held that Event's lock (a supervisor's
SIGKILL a moment after its SIGTERM) leaves the main process blocked forever. Sluice's cluster
stops in bounded time (settings.SHUTDOWN_S): its workers hand their current step back at once,
the Event is set from a thread that may block without blocking the shutdown, and whatever is
still alive at the bound is killed.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
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


class WorkerStopping(SystemExit):
    """SIGTERM reached a worker: the step it runs hands its task back, then the worker exits."""


def _stop_worker(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM (the cluster forwards one, an operator sends another) must not break
    # off the hand-back the first one started; the cluster's shutdown bound still ends the worker.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise WorkerStopping(0)


def worker(task_queue: Any, *args: Any, **kwargs: Any) -> None:
    from django_q.worker import worker as q2_worker

    signal.signal(signal.SIGTERM, _stop_worker)
    if os.environ.get("Q_CLUSTER_NAME"):  # a lane's worker: it runs its lane's pre-checks
        from tasks.precheck import sandbox

        sandbox.prestart()
    q2_worker(NonBlockingReads(task_queue), *args, **kwargs)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        children = [c for p in frontier for c in parents.get(p, []) if c not in found]
        found.update(children)
        frontier = children
    return found


def _alive(pids: set[int]) -> set[int]:
    """The processes of `pids` still running (a zombie has finished), wherever they now hang."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.add(pid)
    return alive


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def bounded_stop(cluster: Any, signum: int, frame: Any) -> None:
    """The cluster's SIGTERM/SIGINT handler: stop taking work, let each worker hand its step back,
    and be gone within settings.SHUTDOWN_S whatever the children do (or did: one killed while
    holding the stop Event's lock would block a plain Event.set forever)."""
    from django.conf import settings

    if getattr(cluster, "_sluice_stopping", False):
        return
    cluster._sluice_stopping = True
    deadline = time.monotonic() + float(settings.SHUTDOWN_S)
    children = descendants(os.getpid())
    sentinel = getattr(cluster, "sentinel", None)
    workers = children - ({sentinel.pid} if sentinel is not None and sentinel.pid else set())
    # Workers first: each hands its current step back (lease released, task due at once) and exits.
    _signal_all(workers, signal.SIGTERM)
    if cluster.stop_event is not None:
        threading.Thread(target=cluster.stop_event.set, name="stop-event", daemon=True).start()
    # Wait for the processes themselves, not for them to be below this one: a sentinel that a
    # supervisor's SIGTERM ended first leaves its workers orphaned, still handing their steps back.
    while time.monotonic() < deadline and _alive(children):
        time.sleep(0.05)
    _signal_all(descendants(os.getpid()) | _alive(children), signal.SIGKILL)
    # Not sys.exit: multiprocessing's exit handler would join the sentinel, which may never end.
    os._exit(0)


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


def preload() -> None:
    """What every step needs, loaded in the cluster's main process before it forks its workers:
    each worker inherits it (shared memory) instead of importing it, and building the TLS
    settings, in its first steps (a second or so of CPU per worker on a busy machine)."""
    import httpcore  # noqa: F401 - httpx imports it when a worker builds its first vendor client
    import tasks.workers  # noqa: F401
    from tasks.services import execution, intake  # noqa: F401
    from tasks.vendors import dialects  # noqa: F401
    from tasks.vendors.http import ssl_context

    for http2 in (False, True):
        ssl_context(http2=http2)


def install() -> None:
    """Have django-q2's sentinel spawn (and recognise) Sluice's worker and monitor. Idempotent.

    SLUICE_Q2_STOCK_WORKERS=1 keeps django-q2's own worker: the benchmark's "raw django-q2"
    reference runs stock django-q2, nothing of Sluice's."""
    if os.environ.get("SLUICE_Q2_STOCK_WORKERS") == "1":
        return
    import django_q.cluster

    if "qcluster" in sys.argv:
        preload()
    django_q.cluster.worker = worker
    django_q.cluster.monitor = monitor
    django_q.cluster.Cluster.sig_handler = bounded_stop
