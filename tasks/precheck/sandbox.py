"""Run the detectors in a separate process with CPU, memory, file-size and wall-clock limits and a
private temporary directory removed afterwards. Whatever the file does to the parser — loop,
allocate, crash — the worker survives and the file is quarantined with the reason.

Each worker has its own sandbox server (tasks/precheck/server.py), started with a lane's worker
(or at its first pre-check): a small interpreter holding only the detectors, which forks one
limited child per file. The worker sends it the file's path and the limits and reads the
child's answer; a server that ends or stops answering is replaced.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks.observability import log_event
from tasks.precheck import DETECTOR_VERSION
from tasks.precheck.server import MAX_OUTPUT
from tasks.precheck.server import kill as _kill

START_S = 30.0  # how long a new server may take to import the detectors
SLACK_S = 10.0  # how much longer than the wall clock a server may take to answer


@dataclass(frozen=True)
class PrecheckResult:
    verdict: str  # "pass" or "quarantine"
    reason: str | None
    findings: dict[str, Any]


class SandboxUnavailable(RuntimeError):
    """The sandbox server could not be started, could not load the configured plugins, or ended
    or stopped answering twice in one pre-check: a fault of this host or its configuration, not
    a verdict on the file (the step fails and is retried)."""


def _registry(*, made: bool = True) -> Path:
    """Where each check's child is registered (for kill_orphans); the server makes it when missing."""
    folder = Path(settings.DATA_DIR) / "precheck-pids"
    if made:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


class _Server:
    """One worker's sandbox server and the pipes to it (one request at a time)."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]  # where plugins may live
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tasks.precheck.server"], cwd=Path(__file__).resolve().parents[2], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.buffer = b""
        self.ready = False
        self.asked = 0

    def usable(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None and not self.process.stdin.closed

    def start(self) -> None:
        """Wait for the server to say it is ready (it imports the detectors first)."""
        if not self.ready:
            self.ready = bool(self.read_line(time.monotonic() + START_S).get("ready"))
            if not self.ready:
                self.stop()
                raise SandboxUnavailable("the pre-check's sandbox server did not start")

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The server's answer to this request, or None when it ended, did not answer in time or
        answered out of turn (then it is stopped)."""
        self.asked += 1
        if self.buffer:
            self.stop()  # something it did not send as an answer to a request
            return None
        try:
            self.process.stdin.write(json.dumps({**request, "id": self.asked}).encode() + b"\n")
            self.process.stdin.flush()
        except (OSError, ValueError):
            self.stop()
            return None
        answer = self.read_line(time.monotonic() + timeout)
        if answer.get("id") != self.asked:
            self.stop()
            return None
        return answer

    def read_line(self, deadline: float) -> dict[str, Any]:
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {}
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                data = os.read(fd, 1 << 20)
                if not data:
                    return {}
                self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

    def stop(self) -> None:
        """Kill the server; its child, if any, dies with it."""
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


_server: _Server | None = None
_lock = threading.Lock()


def prestart() -> None:
    """Start this worker's server now (a lane's worker does, as it starts), so that its start is
    not paid by the first file, and clear what servers killed earlier left behind. Best effort:
    a server that cannot start now is started by the first pre-check (or fails that step)."""
    global _server
    with _lock:
        try:
            kill_orphans()
            if _server is None or not _server.usable():
                _server = _Server()
        except OSError as exc:
            log_event("precheck_sandbox_unavailable", logging.WARNING, exception=type(exc).__name__)


def _ask(request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request to this worker's server (started or replaced when needed) and return its
    answer. A server that ends or stops answering is a fault of this host, not a verdict on the
    file (the server keeps the file's wall clock itself): it is replaced once, then this raises."""
    global _server
    with _lock:
        for _ in range(2):
            if _server is None or not _server.usable():
                _server = _Server()
            server = _server
            server.start()
            answer = server.ask(request, timeout)
            if answer is not None:
                if "error" in answer:
                    raise SandboxUnavailable(f"the pre-check's sandbox server refused the request: {answer['error']}"[:300])
                return answer
            _server = None
        raise SandboxUnavailable("the pre-check's sandbox server ended or stopped answering twice in one pre-check")


def run_precheck(path: Path, extension: str) -> PrecheckResult:
    wall_s = float(settings.PRECHECK_WALL_S)
    request = {
        "path": str(path), "extension": extension, "plugins": list(settings.PRECHECK_PLUGINS),
        "cpu_s": int(settings.PRECHECK_CPU_S), "memory_mb": int(settings.PRECHECK_MEMORY_MB), "wall_s": wall_s,
        "tmp_root": str(settings.FILE_UPLOAD_TEMP_DIR) if settings.FILE_UPLOAD_TEMP_DIR else None,
        "registry": str(_registry(made=False)),
    }
    answer = _ask(request, wall_s + SLACK_S)
    if answer.get("timed_out"):
        return _crashed("precheck_timeout", "the pre-check exceeded its wall-clock limit")
    output, status = answer["output"].encode("latin-1"), int(answer["status"])
    if len(output) > MAX_OUTPUT:
        return _crashed("precheck_crashed", "the pre-check produced more output than allowed")
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        reason = "precheck_timeout" if name in ("SIGXCPU", "SIGKILL") else "precheck_crashed"
        return _crashed(reason, f"the pre-check was killed by {name}")
    try:
        result = json.loads(output or b"{}")
    except ValueError:
        return _crashed("precheck_crashed", f"the pre-check exited {os.WEXITSTATUS(status)} without a verdict")
    if not result.get("ok"):
        error_class = str(result.get("error_class", "unknown"))[:40]
        return _crashed("precheck_crashed", f"the pre-check failed with {error_class}", error_class=error_class)
    findings = result["findings"]
    return PrecheckResult(verdict=findings["verdict"], reason=findings.get("reason"), findings=findings)


def _crashed(reason: str, note: str, **extra: Any) -> PrecheckResult:
    findings = {
        "detector_version": DETECTOR_VERSION, "verdict": "quarantine", "reason": reason, "notes": [note],
        "risk": "unknown", **extra,
    }
    return PrecheckResult(verdict="quarantine", reason=reason, findings=findings)


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
    """Whether `pid` runs: a zombie does not (a dead server's parent may never reap it: in a
    container, PID 1 often reaps nothing)."""
    if pid <= 0:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False
