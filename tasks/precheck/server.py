"""The pre-check's sandbox server: a small process of its own per worker that forks one limited
child per file (sandbox.py starts it and talks to it).

Forking the worker itself for each file cost the worker about 8 ms of CPU per file whatever the
file was: copying the page tables of a 70 MB process, then a copy-on-write fault for each page
it touched afterwards. This server is a fresh interpreter holding only the detectors (no Django,
no settings, no secrets, no connections), so a fork of it is cheap and the worker's own memory is
never shared with a child that reads hostile files.

    python -m tasks.precheck.server

It reads one request per line on stdin (JSON: the file's path and extension, the limits, the
plugins, where to make the private temp directory and where to register the child) and answers
each on stdout with one line (JSON: the child's output, its wait status, whether its wall clock
ran out). It ends when stdin closes or its worker dies (the kernel kills it then, and each child
dies with it). The child sets its limits, inspects, writes one JSON document to a pipe and exits.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MAX_OUTPUT = 1024 * 1024
_PR_SET_PDEATHSIG = 1


def _prctl():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None


_PRCTL = _prctl()  # loaded once: each check's child calls it


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (SIGKILL included)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def virtual_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def check(request: dict[str, Any], inspect) -> dict[str, Any]:
    """Run the detectors on one file in a limited child; what it wrote and how it ended (or why
    it was not run: a plugin that cannot be loaded is this installation's fault, not the file's)."""
    try:
        plugins = [_plugin(dotted) for dotted in request["plugins"]]
    except Exception as exc:
        return {"error": f"plugin {exc.args[0] if exc.args else ''!s} cannot be loaded ({type(exc).__name__})"}
    tmp = Path(tempfile.mkdtemp(prefix="precheck-", dir=request["tmp_root"]))
    limits = (int(request["cpu_s"]), virtual_size() + int(request["memory_mb"]) * 1024 * 1024)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(write_end, Path(request["path"]), request["extension"], plugins, tmp, limits, inspect)
    os.close(write_end)
    marker = Path(request["registry"]) / str(pid)  # the child's marker, for kill_orphans
    try:
        entry = json.dumps({"parent": os.getpid(), "tmp": str(tmp)})
        try:
            marker.write_text(entry)
        except FileNotFoundError:  # the folder is made once, when missing
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(entry)
        output, status, timed_out = _collect(pid, read_end, float(request["wall_s"]))
        return {"output": output.decode("latin-1"), "status": status, "timed_out": timed_out}
    finally:
        os.close(read_end)
        marker.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _plugin(dotted: str):
    """A detector plugin (module.function), imported here once: plugins are this installation's
    code, run on each file in the child."""
    import importlib

    module_name, _, attribute = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except Exception:
        raise LookupError(dotted) from None


def _collect(pid: int, fd: int, wall_s: float) -> tuple[bytes, int, bool]:
    """Read the child's answer until it has exited and closed the pipe, or the wall clock runs out
    (then kill it). Returns (output, wait status, timed out)."""
    deadline = time.monotonic() + wall_s
    chunks: list[bytes] = []
    size = 0
    pipe_open = True
    status: int | None = None
    while pipe_open or status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if status is None:
                kill(pid)
                os.waitpid(pid, 0)
            else:  # reaped (its pid may be reused): what it left holding the pipe is in its group
                kill(pid, group_only=True)
            return b"", 0, True
        if status is None:
            reaped, wait_status = os.waitpid(pid, os.WNOHANG)
            if reaped:
                status = wait_status  # reaped once: never wait for this pid again
        if pipe_open:
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.05))
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    pipe_open = False
                elif size <= MAX_OUTPUT:
                    chunks.append(data)
                    size += len(data)
        elif status is None:
            time.sleep(0.002)
    return b"".join(chunks), status, False


def _child(fd: int, path: Path, extension: str, plugins: list, tmp: Path, limits: tuple[int, int], inspect) -> None:
    code = 3
    try:
        os.setsid()
        die_with_parent()  # the server's death (its worker's) ends the check too
        # Nothing a parser or plugin prints reaches the server's answers (its stdout).
        devnull = os.open(os.devnull, os.O_RDWR)
        for standard in (0, 1, 2):
            os.dup2(devnull, standard)
        cpu_s, memory = limits
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.chdir(tmp)
        os.environ["TMPDIR"] = str(tmp)
        tempfile.tempdir = str(tmp)
        try:
            findings = inspect(path, extension)
            for plugin in plugins:
                plugin(path, findings)
            answer = {"ok": True, "findings": findings}
            code = 0
        except BaseException as exc:
            answer = {"ok": False, "error_class": type(exc).__name__}
        data = json.dumps(answer).encode()
        while data:
            written = os.write(fd, data)
            data = data[written:]
    finally:
        os._exit(code)


def kill(pid: int, *, group_only: bool = False) -> None:
    """Kill a check's child and its process group (the child leads its own)."""
    targets = [lambda: os.killpg(pid, signal.SIGKILL)]
    if not group_only:
        targets.append(lambda: os.kill(pid, signal.SIGKILL))
    for target in targets:
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def serve(requests, answers) -> None:
    from tasks.precheck.detectors import inspect  # once, before the first fork

    answers.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    answers.flush()
    for line in requests:
        request = json.loads(line)
        answers.write(json.dumps({**check(request, inspect), "id": request.get("id")}) + "\n")
        answers.flush()


def main() -> None:
    die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # each child's exit status is read
    # A stopping cluster signals every process below it: the server and its child end with their
    # worker (the kernel kills them then), not before it, so a check is never cut off and taken
    # for the file's crash while the worker could still record it. The child inherits this.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
