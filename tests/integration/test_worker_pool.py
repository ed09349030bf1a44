"""A lane's cluster keeps working when its idle workers are killed (an OOM kill, a kill -9).

A django-q2 worker waiting for work blocks inside the task queue's cross-process read lock; killed
there, it died holding the lock and every other worker of the cluster waited forever, reincarnated
ones included (django-q2 issue #23). Sluice's workers wait without holding it (tasks/q2pool.py).
Real processes: a lane's qcluster, its workers, SIGKILL."""

import os
import signal
import time
from pathlib import Path

import pytest

from tasks.queueing import send
from tests.conftest import TEST_TIME_SCALE, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def run_probe(directory: Path, name: str, *, hold_s: float = 0.0) -> None:
    send("tests.support.probe.note_pid", str(directory), name, hold_s, cluster="interactive")


def test_a_lane_keeps_taking_work_after_its_idle_processes_are_killed(tmp_path):
    from django.conf import settings
    from django_q.brokers import get_broker

    from tasks.system import Stack

    seen = tmp_path / "pids"
    seen.mkdir()
    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    try:
        stack.start_cluster("interactive", workers=2)
        # Two probes held long enough to occupy both workers: their pids are the pool.
        run_probe(seen, "a", hold_s=1.0)
        run_probe(seen, "b", hold_s=1.0)
        wait_for(lambda: len(list(seen.glob("*.pid"))) == 2, timeout=60, message="both workers to run a probe")
        workers = {int(p.read_text()) for p in seen.glob("*.pid")}
        assert len(workers) == 2, workers
        # The sentinel's other children: the pusher and the monitor (which waits on the result queue).
        sentinel = _children(stack.processes["cluster-interactive"].process.pid)
        helpers = {pid for s in sentinel for pid in _children(s)} - workers
        assert len(helpers) == 2, helpers
        time.sleep(1.0)  # all idle again, waiting for work (or for results)
        for pid in workers | helpers:
            os.kill(pid, signal.SIGKILL)
        time.sleep(2.0)  # the cluster's guard notices and starts new ones

        run_probe(seen, "after")
        wait_for(lambda: (seen / "after.pid").exists(), timeout=30,
                 message="a worker of the cluster to take work after its idle workers were killed")
        assert int((seen / "after.pid").read_text()) not in workers
        if "orm" in settings.Q_CLUSTER:
            # The new monitor received the result and acknowledged the message (the ORM broker
            # keeps a message until then, and would deliver it again).
            broker = get_broker("interactive")
            wait_for(lambda: broker.queue_size() == 0 and broker.lock_size() == 0, timeout=30,
                     message="the monitor to acknowledge the probe")
    finally:
        stack.stop_all()


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


@pytest.mark.parametrize("lane,expected", [("interactive", 0), ("batch", 5), ("heavy", 10)])
def test_a_lane_cluster_runs_at_its_lanes_cpu_priority(lane, expected):
    """Best-effort lanes' processes yield the CPU to interactive work (settings.LANE_NICE)."""
    import subprocess
    import sys

    from django.conf import settings

    probe = "import os; print(os.nice(0))"
    env = {**os.environ, "Q_CLUSTER_NAME": lane}
    own = os.nice(0)
    done = subprocess.run([sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "shell", "-c", probe],
                          env=env, capture_output=True, text=True, timeout=60, cwd=settings.BASE_DIR)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip().splitlines()[-1]) == min(own + expected, 19)
