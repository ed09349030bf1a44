"""Starting and stopping a whole Sluice system as real processes on loopback.

Used by the POC runner, the benchmarks and the integration tests: a fake vendor, the web server
(gunicorn), the dispatcher and one django-q2 cluster per lane, all against one database. Every
process runs in its own session, so stopping kills its children too and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from django.conf import settings
from django.db import connection

BASE = Path(settings.BASE_DIR)
# gunicorn's own limits, the largest it allows: the API's longest declared path or query fits,
# so no declared request is refused by the server before Sluice sees it (docs/deployment.md).
GUNICORN_LIMITS = ("--limit-request-line", "8190", "--limit-request-field_size", "8190")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_env() -> dict[str, str]:
    """Environment that points child processes at the database this process uses now."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return {"SLUICE_DATABASE_PATH": str(db["NAME"]), "DATABASE_URL": ""}
    user = db.get("USER") or ""
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    return {"DATABASE_URL": f"postgres://{auth}{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}/{db['NAME']}"}


@dataclass
class Managed:
    name: str
    process: subprocess.Popen
    log: IO[bytes]


@dataclass
class Stack:
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, Managed] = field(default_factory=dict)
    # Where its processes run: a prefix for every command (e.g. `ip netns exec <host>`, see
    # tasks/hosts.py) and the address its servers bind.
    wrap: list[str] = field(default_factory=list)
    bind: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **database_env(), **self.env, **(extra or {})}
        # Children log to their own file (stdout/stderr of each process is kept in log_dir).
        env.update(SLUICE_LOG_FILE="", SLUICE_LOG_STDERR="1")
        return {k: v for k, v in env.items() if v is not None}

    def spawn(self, name: str, command: list[str], *, extra_env: dict[str, str] | None = None) -> Managed:
        log = open(self.log_dir / f"{name}.log", "ab")
        process = subprocess.Popen(
            [*self.wrap, *command], cwd=BASE, env=self._env(extra_env), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        managed = Managed(name=name, process=process, log=log)
        self.processes[name] = managed
        # A record of every process group started, so an interrupted run can be cleaned up.
        with open(self.log_dir / "pids.txt", "a") as pids:
            pids.write(f"{process.pid}\n")
        return managed

    def manage(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> Managed:
        return self.spawn(name, [sys.executable, str(BASE / "manage.py"), *args], extra_env=extra_env)

    # --- parts ------------------------------------------------------------------------------
    def start_vendor(self, name: str = "vendor", *, time_scale: float | None = None, seed: int = 0,
                     channels: dict | None = None, processing_ms: float | None = None, timeout: float = 30,
                     extra_args: tuple[str, ...] = ()) -> str:
        """A fake vendor; `extra_args` go to its command (e.g. proxy mode's `--upstream URL`)."""
        ready = self.log_dir / f"{name}.port"
        ready.unlink(missing_ok=True)
        args = ["fakevendor", "--port", "0", "--seed", str(seed), "--ready-file", str(ready),
                "--data-dir", str(self.log_dir / f"{name}-data"), "--host", self.bind]
        if time_scale is not None:
            args += ["--time-scale", str(time_scale)]
        if processing_ms is not None:
            args += ["--processing-ms", str(processing_ms)]
        if channels:
            spec = self.log_dir / f"{name}-channels.json"
            spec.write_text(json.dumps(channels))
            args += ["--channels", str(spec)]
        self.manage(name, *args, *extra_args)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready.exists() and ready.read_text().strip():
                return f"http://{self.bind}:{ready.read_text().strip()}"
            self._check_alive(name)
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start; see {self.log_dir / (name + '.log')}")

    def start_web(self, name: str = "web", *, workers: int = 2, threads: int = 8, timeout: float = 30) -> str:
        port = free_port()
        self.spawn(name, [
            sys.executable, "-m", "gunicorn", "console.wsgi", "--bind", f"{self.bind}:{port}",
            "--worker-class", "gthread", "--workers", str(workers), "--threads", str(threads),
            "--timeout", "120", "--graceful-timeout", "5", *GUNICORN_LIMITS,
        ])
        url = f"http://{self.bind}:{port}"
        self.wait_http(f"{url}/healthz", name=name, timeout=timeout)
        return url

    def start_dispatcher(self, name: str = "dispatcher") -> None:
        self.manage(name, "dispatcher")

    def start_cluster(self, lane: str | None = None, *, workers: int | None = None) -> None:
        """The control cluster (lane None) or one lane's cluster."""
        extra: dict[str, str] = {}
        if lane:
            extra["Q_CLUSTER_NAME"] = lane
            if workers:
                extra["SLUICE_LANE_WORKERS"] = f"{lane}={workers}"
        elif workers:
            extra["SLUICE_CONTROL_WORKERS"] = str(workers)
        self.manage(f"cluster-{lane or 'control'}", "qcluster", extra_env=extra)

    def start_all_clusters(self, *, workers: int | None = None) -> None:
        self.start_cluster(None, workers=workers)
        for lane in settings.LANES:
            self.start_cluster(lane, workers=workers)

    # --- control ------------------------------------------------------------------------------
    def wait_http(self, url: str, *, name: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            self._check_alive(name)
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not answer at {url}; see {self.log_dir / (name + '.log')}")

    def wait_logged(self, name: str, text: str, *, timeout: float = 60) -> None:
        """Until `text` appears in the log of process `name` (e.g. a cluster's "] running.", logged
        by django-q2 at INFO: the process needs SLUICE_Q_LOG_LEVEL=INFO)."""
        path = self.log_dir / f"{name}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in path.read_text(errors="replace"):
                return
            self._check_alive(name)
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not log {text!r} within {timeout} s; see {path}")

    def _check_alive(self, name: str) -> None:
        managed = self.processes[name]
        if managed.process.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {managed.process.returncode}; see {self.log_dir / (name + '.log')}"
            )

    def stop(self, name: str, *, sig: int = signal.SIGTERM, wait: float = 10) -> None:
        managed = self.processes.pop(name, None)
        if managed is None:
            return
        _signal_leader(managed.process, sig)
        try:
            managed.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            _signal_group(managed.process, signal.SIGKILL)
            managed.process.wait(timeout=5)
        _signal_group(managed.process, signal.SIGKILL)  # stragglers of the group
        managed.log.close()

    def stop_all(self) -> None:
        # The leader shuts its own children down in order; whatever is left is killed.
        for name in list(self.processes):
            _signal_leader(self.processes[name].process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for name in list(self.processes):
            managed = self.processes[name]
            try:
                managed.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for name in list(self.processes):
            self.stop(name, sig=signal.SIGKILL, wait=5)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _signal_leader(process: subprocess.Popen, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
