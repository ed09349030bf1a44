"""Graceful shutdown drains and always ends (issue 15): what a supervisor does — SIGTERM to every
process, SIGKILL a moment later to those left — must leave no Sluice process behind, and a step
that was running is handed back at once, not after its lease expires. Real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tasks.models import Task
from tests.conftest import TEST_TIME_SCALE, run_until, wait_for
from tests.support.flows import submit_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
BOUND_S = 30


def descendants(pid: int) -> set[int]:
    found, frontier = set(), {pid}
    while frontier:
        children = {child for parent in frontier for child in _children(parent)}
        frontier = children - found
        found |= children
    return found


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


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return stat[0] != "Z"


def test_a_cluster_whose_children_are_killed_while_it_stops_still_exits_in_bounded_time(tmp_path):
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    try:
        stack.start_cluster("interactive", workers=2)
        main = stack.processes["cluster-interactive"].process
        wait_for(lambda: len(descendants(main.pid)) >= 4, timeout=60, message="the cluster's sentinel, pusher, monitor, workers")
        time.sleep(1.0)
        children = descendants(main.pid)
        # The supervisor: SIGTERM to everyone, then SIGKILL to the children a second later.
        for pid in {main.pid, *children}:
            os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        started = time.monotonic()
        while main.poll() is None and time.monotonic() - started < BOUND_S + 5:
            time.sleep(0.2)
        assert main.poll() is not None, f"the cluster's main process was still alive {BOUND_S + 5}s after its children died"
        assert not [p for p in children if alive(p)]
    finally:
        stack.stop_all()


def test_sigterm_to_a_cluster_alone_stops_it_within_the_bound_and_leaves_no_child(tmp_path):
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    try:
        stack.start_cluster("interactive", workers=2)
        main = stack.processes["cluster-interactive"].process
        wait_for(lambda: len(descendants(main.pid)) >= 4, timeout=60, message="the cluster's processes")
        children = descendants(main.pid)
        os.kill(main.pid, signal.SIGTERM)
        main.wait(timeout=BOUND_S + 5)
        wait_for(lambda: not [p for p in children if alive(p)], timeout=10, message="every child to be gone")
    finally:
        stack.stop_all()


def test_a_step_running_at_sigterm_is_handed_back_at_once_not_after_its_lease(vendor, api, tmp_path):
    """A worker stopped mid-upload gives its task back: reconciled and taken by another worker
    well before the lease would have expired."""
    from tasks.models import VendorChannel
    from tasks.system import Stack

    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    vendor.control.add_rule({"endpoint": "POST /v1/uploads", "type": "bandwidth", "params": {"bytes_per_s": 30_000},
                             "times": 1})
    env = {"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05", "SLUICE_LEASE_S": "600"}
    stack = Stack(log_dir=tmp_path / "s", env=env)
    try:
        stack.start_dispatcher()
        stack.start_cluster(None, workers=1)
        stack.manage("lane-a", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        from tasks.poc import files

        task_id = submit_file(api, files.wav(30))
        wait_for(lambda: Task.objects.filter(pk=task_id, state="RUNNING", phase="upload").exists(), timeout=60,
                 message="the upload to be under way")
        main = stack.processes["lane-a"].process
        for pid in {main.pid, *descendants(main.pid)}:
            os.kill(pid, signal.SIGTERM)
        handed_back = time.monotonic()
        stack.manage("lane-b", "qcluster", extra_env={"Q_CLUSTER_NAME": "interactive", "SLUICE_LANE_WORKERS": "interactive=1"})
        task = run_until(task_id, timeout=60)
        assert task.state == "SUCCEEDED"
        # The lease was 600 nominal seconds (30 real): it was not waited out.
        assert time.monotonic() - handed_back < 600 * TEST_TIME_SCALE
        assert any("handed back" in e.reason for e in task.events.all()), list(task.events.values_list("reason", flat=True))
        main.wait(timeout=BOUND_S)
    finally:
        stack.stop_all()


def test_sigterm_to_the_web_server_or_the_dispatcher_alone_stops_it_within_the_bound(tmp_path):
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    try:
        stack.start_web()
        stack.start_dispatcher()
        time.sleep(1.0)
        for name in ("web", "dispatcher"):
            process = stack.processes[name].process
            children = descendants(process.pid)
            assert process.poll() is None, f"{name} did not start"
            os.kill(process.pid, signal.SIGTERM)
            process.wait(timeout=BOUND_S)
            wait_for(lambda: not [p for p in children if alive(p)], timeout=10, message=f"{name}'s children to be gone")
    finally:
        stack.stop_all()


def test_ctrl_c_on_the_run_command_leaves_no_process_behind(tmp_path):
    """`make run` ends in `honcho start -f Procfile`: Ctrl-C there (SIGINT to its process group, as
    a terminal sends it) stops web, dispatcher, every cluster and the fake vendor."""
    import subprocess

    from tasks.system import BASE, database_env, free_port

    env = {**os.environ, **database_env(), "SLUICE_DATA_DIR": str(tmp_path / "data"), "SLUICE_PORT": str(free_port()),
           "FAKEVENDOR_PORT": str(free_port()), "SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_LOG_FILE": ""}
    env.pop("PYTEST_VERSION", None)
    with open(tmp_path / "run.log", "wb") as log:
        run = subprocess.Popen([str(Path(BASE) / ".venv" / "bin" / "honcho"), "start", "-f", "Procfile"], cwd=BASE, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: len(descendants(run.pid)) >= 9 + 4 * 5, timeout=90,
                     message="web, dispatcher, the clusters and the fake vendor to be running")
            time.sleep(2.0)
            everyone = descendants(run.pid)
            os.killpg(run.pid, signal.SIGINT)
            run.wait(timeout=BOUND_S + 10)
            wait_for(lambda: not [p for p in everyone if alive(p)], timeout=BOUND_S,
                     message="every process started by the run command to be gone")
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    assert b"Traceback" not in (tmp_path / "run.log").read_bytes().split(b"SIGINT")[0], (tmp_path / "run.log").read_text()[-3000:]
