"""Run the detectors in a separate process with CPU, memory, file-size and wall-clock limits and a
private temporary directory removed afterwards. Whatever the file does to the parser — loop,
allocate, crash — the worker survives and the file is quarantined with the reason.

The separate process is a fork of the worker (the detectors are already imported, so a pre-check
costs milliseconds, not an interpreter start): the child sets its limits, inspects, writes one
JSON document to a pipe and exits without touching anything the parent owns.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks.precheck import DETECTOR_VERSION

MAX_OUTPUT = 1024 * 1024
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class PrecheckResult:
    verdict: str  # "pass" or "quarantine"
    reason: str | None
    findings: dict[str, Any]


def _registry() -> Path:
    folder = Path(settings.DATA_DIR) / "precheck-pids"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _register(pid: int, entry: dict[str, Any]) -> Path:
    """The child's marker (for kill_orphans), its folder made only when it is missing."""
    marker = Path(settings.DATA_DIR) / "precheck-pids" / str(pid)
    try:
        marker.write_text(json.dumps(entry))
    except FileNotFoundError:
        marker = _registry() / str(pid)
        marker.write_text(json.dumps(entry))
    return marker


def _virtual_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_precheck(path: Path, extension: str) -> PrecheckResult:
    from tasks.precheck.detectors import inspect  # imported here, in the parent, once

    tmp = Path(tempfile.mkdtemp(prefix="precheck-", dir=settings.FILE_UPLOAD_TEMP_DIR))
    plugins = list(settings.PRECHECK_PLUGINS)
    limits = (int(settings.PRECHECK_CPU_S), _virtual_size() + int(settings.PRECHECK_MEMORY_MB) * 1024 * 1024)
    read_end, write_end = os.pipe()
    # django-q2's workers ignore SIGCHLD (children are reaped by the kernel): we need the exit
    # status, so restore the default while our child lives.
    restore = _default_sigchld()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        _child(write_end, path, extension, plugins, tmp, limits, inspect)
    os.close(write_end)
    marker = _register(pid, {"parent": os.getpid(), "tmp": str(tmp)})
    try:
        output, status, timed_out = _collect(pid, read_end, float(settings.PRECHECK_WALL_S))
        if timed_out:
            return _crashed("precheck_timeout", "the pre-check exceeded its wall-clock limit")
        if len(output) > MAX_OUTPUT:
            return _crashed("precheck_crashed", "the pre-check produced more output than allowed")
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            reason = "precheck_timeout" if name in ("SIGXCPU", "SIGKILL") else "precheck_crashed"
            return _crashed(reason, f"the pre-check was killed by {name}")
        try:
            answer = json.loads(output or b"{}")
        except ValueError:
            return _crashed("precheck_crashed", f"the pre-check exited {os.WEXITSTATUS(status)} without a verdict")
        if not answer.get("ok"):
            error_class = str(answer.get("error_class", "unknown"))[:40]
            return _crashed("precheck_crashed", f"the pre-check failed with {error_class}", error_class=error_class)
        findings = answer["findings"]
        return PrecheckResult(verdict=findings["verdict"], reason=findings.get("reason"), findings=findings)
    finally:
        os.close(read_end)
        marker.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        restore()


def _default_sigchld():
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return lambda: signal.signal(signal.SIGCHLD, previous)


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
            _kill(pid)
            if status is None:
                os.waitpid(pid, 0)
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


def _child(fd: int, path: Path, extension: str, plugins: list[str], tmp: Path, limits: tuple[int, int], inspect) -> None:
    code = 3
    try:
        os.setsid()
        try:
            # If the worker dies (SIGKILL), the kernel kills the pre-check too.
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
        cpu_s, memory = limits
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.chdir(tmp)
        os.environ["TMPDIR"] = str(tmp)
        tempfile.tempdir = str(tmp)
        try:
            import importlib

            findings = inspect(path, extension)
            for dotted in plugins:
                module_name, _, attribute = dotted.rpartition(".")
                getattr(importlib.import_module(module_name), attribute)(path, findings)
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


def _crashed(reason: str, note: str, **extra: Any) -> PrecheckResult:
    findings = {
        "detector_version": DETECTOR_VERSION, "verdict": "quarantine", "reason": reason, "notes": [note],
        "risk": "unknown", **extra,
    }
    return PrecheckResult(verdict="quarantine", reason=reason, findings=findings)


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def kill_orphans() -> int:
    """Kill pre-checks whose worker died on this host and remove their temp directories."""
    killed = 0
    for marker in _registry().iterdir():
        try:
            info = json.loads(marker.read_text())
            pid = int(marker.name)
        except (ValueError, OSError):
            marker.unlink(missing_ok=True)
            continue
        if _alive(int(info.get("parent", 0))):
            continue
        if _alive(pid):
            _kill(pid)
            killed += 1
        shutil.rmtree(info.get("tmp", ""), ignore_errors=True)
        marker.unlink(missing_ok=True)
    return killed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
