"""Run the detectors in a separate process with CPU, memory, file-size and wall-clock limits and a
private temporary directory removed afterwards. Whatever the file does to the parser — loop,
allocate, crash — the worker survives and the file is quarantined with the reason.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks.precheck import DETECTOR_VERSION

RUNNER = Path(__file__).with_name("runner.py")
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


def _limit(cpu_s: int, memory_mb: int) -> Any:
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            import ctypes

            # If the worker dies (SIGKILL), the kernel kills the pre-check too.
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass

    return apply


def run_precheck(path: Path, extension: str) -> PrecheckResult:
    tmp = Path(tempfile.mkdtemp(prefix="precheck-", dir=settings.FILE_UPLOAD_TEMP_DIR))
    env = {
        "PATH": "/usr/bin:/bin",
        "TMPDIR": str(tmp),
        "HOME": str(tmp),
        "PYTHONPATH": str(settings.BASE_DIR),
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    }
    command = [sys.executable, str(RUNNER), str(path), extension or "", *settings.PRECHECK_PLUGINS]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=tmp, env=env,
        preexec_fn=_limit(int(settings.PRECHECK_CPU_S), int(settings.PRECHECK_MEMORY_MB)),
    )
    marker = _registry() / f"{process.pid}"
    marker.write_text(json.dumps({"parent": os.getpid(), "tmp": str(tmp)}))
    try:
        try:
            out, _ = process.communicate(timeout=float(settings.PRECHECK_WALL_S))
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait()
            return _crashed("precheck_timeout", "the pre-check exceeded its wall-clock limit")
        if len(out) > MAX_OUTPUT:
            return _crashed("precheck_crashed", "the pre-check produced more output than allowed")
        if process.returncode < 0:
            name = signal.Signals(-process.returncode).name
            reason = "precheck_timeout" if name in ("SIGXCPU", "SIGKILL") else "precheck_crashed"
            return _crashed(reason, f"the pre-check was killed by {name}")
        try:
            answer = json.loads(out or b"{}")
        except ValueError:
            return _crashed("precheck_crashed", f"the pre-check exited {process.returncode} without a verdict")
        if not answer.get("ok"):
            error_class = str(answer.get("error_class", "unknown"))[:40]
            reason = "precheck_crashed"
            return _crashed(reason, f"the pre-check failed with {error_class}", error_class=error_class)
        findings = answer["findings"]
        return PrecheckResult(verdict=findings["verdict"], reason=findings.get("reason"), findings=findings)
    finally:
        marker.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _crashed(reason: str, note: str, **extra: Any) -> PrecheckResult:
    findings = {
        "detector_version": DETECTOR_VERSION, "verdict": "quarantine", "reason": reason, "notes": [note],
        "risk": "unknown", **extra,
    }
    return PrecheckResult(verdict="quarantine", reason=reason, findings=findings)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
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
            _kill_group(pid)
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
