"""Scratch databases for runs that start their own system (POC scenarios, benchmarks): a freshly
migrated template (SQLite file or PostgreSQL database), copied for each run, dropped afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError

MANAGE = str(Path(settings.BASE_DIR) / "manage.py")


class Scratch:
    """Scratch databases for scenario runs: a migrated template, copied per scenario."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_dir.name
        self.database_url = settings.DATABASE_URL
        self.created_databases: list[str] = []
        self.children: list[subprocess.Popen] = []

    def _env(self, workdir: Path, database: str | None, q_name: str) -> dict[str, str]:
        env = {**os.environ, "SLUICE_DATA_DIR": str(workdir / "data"), "SLUICE_Q_NAME": q_name, "SLUICE_LOG_FILE": ""}
        env.pop("PYTEST_VERSION", None)
        if self.database_url:
            env["DATABASE_URL"] = self._url_for(database)
        else:
            env["DATABASE_URL"] = ""
            env["SLUICE_DATABASE_PATH"] = database
        return env

    def _url_for(self, name: str) -> str:
        base, _, _ = self.database_url.rpartition("/")
        return f"{base}/{name}"

    def _admin(self, sql: str) -> None:
        import dj_database_url
        import psycopg

        db = dj_database_url.parse(self.database_url)
        with psycopg.connect(host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"] or None,
                             password=db["PASSWORD"] or None, dbname=db["NAME"], autocommit=True) as conn:
            conn.execute(sql)

    def prepare_template(self) -> None:
        workdir = self.run_dir / "template"
        workdir.mkdir(parents=True, exist_ok=True)
        if self.database_url:
            self.template = f"sluice_poc_{self.run_id}_tpl"
            self._admin(f'CREATE DATABASE "{self.template}"')
            self.created_databases.append(self.template)
            database = self.template
        else:
            self.template = str(workdir / "template.sqlite3")
            database = self.template
        env = self._env(workdir, database, f"poc{self.run_id}tpl")
        done = subprocess.run([sys.executable, MANAGE, "migrate", "--noinput"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise CommandError(f"migrating the scratch database failed:\n{done.stderr[-2000:]}")

    def database_for(self, workdir: Path, index: int) -> str:
        """A fresh copy of the template for one run."""
        if self.database_url:
            database = f"sluice_poc_{self.run_id}_{index}"
            self._admin(f'CREATE DATABASE "{database}" TEMPLATE "{self.template}"')
            self.created_databases.append(database)
            return database
        database = str(workdir / "sluice.sqlite3")
        # Through SQLite, not as a file: pages still in the template's WAL are part of it.
        with closing(sqlite3.connect(self.template)) as source, closing(sqlite3.connect(database)) as copy:
            source.backup(copy)
        return database

    def child_env(self, workdir: Path, index: int) -> dict[str, str]:
        return self._env(workdir, self.database_for(workdir, index), f"poc{self.run_id}{index}")

    def run_child(self, name: str, index: int, *, seed: int, tasks: int, time_scale: float, quiet: bool,
                  dialect: str = "sluice") -> dict[str, Any]:
        workdir = self.run_dir / f"{index:02d}-{name}"
        workdir.mkdir(parents=True, exist_ok=True)
        env = self.child_env(workdir, index)
        env["SLUICE_TIME_SCALE"] = str(time_scale)
        # The run's own log goes next to its processes' logs (and is scanned for secrets too).
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        env.update(SLUICE_LOG_FILE=str(workdir / "logs" / "runner.log"), SLUICE_LOG_STDERR="0")
        report_file = workdir / "report.json"
        command = [sys.executable, MANAGE, "poc", "_child", name, "--seed", str(seed), "--tasks", str(tasks),
                   "--time-scale", str(time_scale), "--workdir", str(workdir), "--report", str(report_file),
                   "--dialect", dialect]
        if quiet:
            command.append("--quiet")
        child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
        self.children.append(child)
        try:
            child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
        if not report_file.exists():
            return {"scenario": name, "seed": seed, "tasks": tasks, "time_scale": time_scale, "passed": False,
                    "duration_s": 0, "error": f"the scenario process exited {child.returncode} without a report",
                    "invariants": [], "metrics": {}}
        report = json.loads(report_file.read_text())
        report["logs"] = str(workdir / "logs")
        return report

    def kill_leftovers(self) -> None:
        """Whatever a child started and did not stop (it was killed itself) is stopped here."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for pids in self.run_dir.glob("*/logs/pids.txt"):
            for line in pids.read_text().split():
                try:
                    os.killpg(int(line), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass

    def cleanup(self, *, keep: bool) -> None:
        if keep:
            return
        for database in reversed(self.created_databases):
            try:
                self._admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            except Exception:
                pass
        shutil.rmtree(self.run_dir, ignore_errors=True)
