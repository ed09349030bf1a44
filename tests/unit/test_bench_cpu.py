"""The benchmark's CPU accounting (tasks/bench/cpu.py) attributes a process tree's CPU to its
root's name, its finished children's included, read from the kernel's own counters."""

from __future__ import annotations

import subprocess
import sys

from tasks.bench import cpu

# Burns about 0.3 s of CPU in a child it starts and waits for (its parent then reaps it), then
# waits to be stopped.
TREE = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass"])
print("done", flush=True)
time.sleep(60)
"""


def test_a_trees_cpu_is_its_roots_its_reaped_childrens_included():
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        before = cpu.cpu_seconds({"tree": root.pid})
        assert root.stdout.readline().strip() == "done"
        after = cpu.cpu_seconds({"tree": root.pid})
        used = cpu.spent(before, after)
        assert 0.25 <= used["tree"] < 2.0, used
        assert set(used) >= {"tree", "postgres", "redis", "other"}
    finally:
        root.kill()
        root.wait()


def test_nothing_spent_is_never_below_zero():
    assert cpu.spent({"a": 2.0, "b": 1.0}, {"a": 1.5, "b": 1.25}) == {"a": 0.0, "b": 0.25}
