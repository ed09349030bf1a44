"""CPU time by process, read from /proc: where a section's CPU went, counted by the kernel.

A sampling profiler shows which functions run; on these machines it also counts sleeping threads
as running, so its shares say little about CPU. The kernel's own accounting does: each process's
user and system time, and its reaped children's (a worker replaced, a pre-check's child);
a descendant still running (a worker's pre-check sandbox server) counts for its ancestor.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
SERVICES = {"postgres": "postgres", "redis-server": "redis"}  # by the command's name


def _processes() -> dict[int, tuple[int, str, float]]:
    """Every live process: its parent, its command name, and the CPU seconds it and its reaped
    children have used."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        head, _, rest = text.rpartition(")")
        fields = rest.split()
        if len(fields) < 15:
            continue
        name = head.partition("(")[2]
        found[int(stat.parent.name)] = (int(fields[1]), name, sum(int(f) for f in fields[11:15]) * TICK_S)
    return found


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process and its descendants, by the database and
    broker servers running here ("postgres", "redis"), and by everything else ("other")."""
    processes = _processes()
    by_pid = {pid: name for name, pid in roots.items()}
    totals = dict.fromkeys([*roots, *SERVICES.values(), "other"], 0.0)
    for pid, (parent, command, seconds) in processes.items():
        owner, seen, cursor = None, 0, pid
        while cursor in processes and seen < 64:
            if cursor in by_pid:
                owner = by_pid[cursor]
                break
            cursor, seen = processes[cursor][0], seen + 1
        if owner is None:
            owner = next((label for prefix, label in SERVICES.items() if command.startswith(prefix)), "other")
        totals[owner] += seconds
    return totals


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each owner used between two readings (a process that ended meanwhile, unreaped
    by anything named, is missing from the second: never below zero)."""
    return {name: max(0.0, after.get(name, 0.0) - before.get(name, 0.0)) for name in after}
