"""`python manage.py bench [--quick]`: the benchmark suite on the embedded default and on
PostgreSQL + Redis (when they answer on 127.0.0.1); a table, and bench/results/latest.json."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import uuid
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from tasks.bench.suite import SECTIONS, TARGETS, run_child, verdicts
from tasks.scratch import MANAGE, Scratch

SETUPS = {
    "sqlite": {"DATABASE_URL": "", "REDIS_URL": ""},
    "postgres_redis": {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/test", "REDIS_URL": "redis://127.0.0.1:6379/0"},
}
ROWS = [
    ("intake (tasks/s vs bare view)", "intake_rps", "bare_view_rps", "intake_ratio"),
    ("batch intake (tasks/s vs single)", "batch_intake_tps", "intake_rps", "batch_vs_single"),
    ("web CPU per submission (ms vs bare view)", "intake_web_cpu_ms", "bare_web_cpu_ms", "intake_web_cpu_ratio"),
    ("SQL statements per task (counted)", "statements_per_task", None, "statements_per_task"),
    ("queue messages per task (counted)", "queue_messages_per_task", None, "queue_messages_per_task"),
    ("pipeline (tasks/s vs raw django-q2)", "pipeline_tps", "raw_q2_tps", "pipeline_vs_q2"),
    ("pipeline (tasks/s vs bare vendor loop)", "pipeline_tps", "bare_vendor_loop_tps", "pipeline_vs_vendor_loop"),
    ("pipeline over a long history (tasks/s)", "history_pipeline_tps", "before_history_pipeline_tps",
     "pipeline_with_history_ratio"),
    ("upload to vendor (MB/s vs curl)", "upload_mb_s", "curl_upload_mb_s", "upload_ratio"),
    ("upload intake (MB/s vs curl)", "intake_upload_mb_s", "curl_upload_mb_s", "intake_upload_ratio"),
    ("peak RSS web / worker (MB)", "web_peak_rss_mb", "worker_peak_rss_mb", "peak_rss_mb"),
    ("status requests per task-minute", "polls_per_task_minute", None, "polls_per_task_minute"),
    ("interactive p95 wait under flood (s)", "interactive_p95_wait_s_under_flood", None, "interactive_p95_wait_s_under_flood"),
    ("convert (documents/min vs bare soffice loop)", "convert_docs_per_min", "bare_convert_docs_per_min", "convert_vs_bare"),
]


class Command(BaseCommand):
    help = "Benchmarks, each figure next to its reference measured in the same run; ratios against targets."

    def add_arguments(self, parser):
        parser.add_argument("--quick", action="store_true", help="Smaller sizes (256 MiB upload, 1,000-task flood).")
        parser.add_argument("--setup", choices=[*SETUPS, "all"], default="all")
        parser.add_argument("--only", default="", help=f"Comma-separated sections to run (of {', '.join(SECTIONS)}); default all.")
        parser.add_argument("--out", default=str(Path(settings.BASE_DIR) / "bench" / "results" / "latest.json"))
        parser.add_argument("--_child", dest="child_out", default=None, help="(internal)")

    def handle(self, *args, quick: bool, setup: str, out: str, only: str, child_out: str | None, **options):
        sections = {s.strip() for s in only.split(",") if s.strip()}
        unknown = sections - set(SECTIONS)
        if unknown:
            raise CommandError(f"Unknown section(s): {', '.join(sorted(unknown))}. Sections: {', '.join(SECTIONS)}.")
        if child_out:
            run_child(Path(child_out).parent, quick=quick, out=Path(child_out), only=sections or None)
            return
        self.run_setups(quick=quick, setup=setup, out=out, only=only)

    def run_setups(self, *, quick: bool, setup: str, out: str, only: str = "") -> None:
        chosen = list(SETUPS) if setup == "all" else [setup]
        results = {}
        for name in chosen:
            env = SETUPS[name]
            if env["DATABASE_URL"] and not _services_up():
                self.stderr.write(f"{name}: PostgreSQL or Redis not reachable on 127.0.0.1; skipped")
                continue
            self.stderr.write(f"== {name}")
            results[name] = self._setup(name, env, quick=quick, only=only)
        document = {
            "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
            "at": timezone.now().isoformat(),
            "quick": quick,
            "setups": results,
            "targets": TARGETS,
            "verdicts": {name: verdicts(figures) for name, figures in results.items()},
        }
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2))
        self._table(document)
        self.stdout.write(f"\nwritten: {path}")

    def _setup(self, name: str, env: dict[str, str], *, quick: bool, only: str = "") -> dict:
        previous = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            scratch = Scratch(Path(settings.DATA_DIR) / "bench" / uuid.uuid4().hex[:8])
            scratch.database_url = env["DATABASE_URL"]
            scratch.prepare_template()
            workdir = scratch.run_dir / name
            workdir.mkdir(parents=True, exist_ok=True)
            child_env = scratch.child_env(workdir, 0)
            child_env.update(env if not env["DATABASE_URL"] else {"REDIS_URL": env["REDIS_URL"]})
            child_env["SLUICE_LOG_STDERR"] = "0"
            out = workdir / "figures.json"
            command = [sys.executable, MANAGE, "bench", "--_child", str(out)] + (["--quick"] if quick else [])
            if only:
                command += ["--only", only]
            try:
                subprocess.run(command, env=child_env, check=False)
            finally:
                scratch.kill_leftovers()
                figures = json.loads(out.read_text()) if out.exists() else {"error": "the benchmark process failed"}
                scratch.cleanup(keep=bool(os.environ.get("SLUICE_BENCH_KEEP")))
            return figures
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _table(self, document: dict) -> None:
        for name, figures in document["setups"].items():
            verdict = document["verdicts"][name]
            self.stdout.write(f"\n{name}")
            self.stdout.write(f"  {'figure':<40} {'value':>10} {'reference':>10} {'ratio':>8} {'target':>8}  verdict")
            for label, key, reference, ratio_key in ROWS:
                value = figures.get(key)
                ref = figures.get(reference) if reference else None
                ratio = figures.get(ratio_key) if ratio_key in figures else None
                target = TARGETS.get(ratio_key)
                ok = verdict.get(ratio_key)
                mark = "—" if ok is None else ("meets" if ok else "MISSES")
                self.stdout.write(f"  {label:<40} {_fmt(value):>10} {_fmt(ref):>10} {_fmt(ratio):>8} {_fmt(target):>8}  {mark}")
            waits = figures.get("interactive_wait_s_under_flood")
            if waits:
                self.stdout.write(f"  interactive wait under flood (s): p50 {_fmt(waits['p50'])}, p95 {_fmt(waits['p95'])}, "
                                  f"max {_fmt(waits['max'])}")
            ahead = figures.get("intake_decisions_ahead")
            if ahead:
                self.stdout.write(f"  intake's decisions taken before the lock: {ahead['kept']} kept, "
                                  f"{ahead['taken_again']} taken again under it")
            kinds = figures.get("statements_per_task_by_kind")
            if kinds:
                largest = ", ".join(f"{name} {value:g}" for name, value in list(kinds.items())[:8])
                self.stdout.write(f"  statements per task, the largest kinds: {largest}")
            for key, label in (("pipeline_cpu_ms_per_task", "pipeline"), ("vendor_loop_cpu_ms_per_task", "bare vendor loop")):
                if figures.get(key):
                    spent = ", ".join(f"{name} {value:g}" for name, value in figures[key].items())
                    self.stdout.write(f"  CPU per task (ms), {label}: {spent}")
            matrix = figures.get("matrix")
            if matrix:
                self.stdout.write(f"  pool size x vendor latency ({matrix['tasks_per_cell']} tasks a cell, deadline 60 s nominal)")
                self.stdout.write(f"  {'workers':>8} {'latency s':>10} {'tasks/s':>8} {'p95 wait s':>11} {'hit deadline':>13}")
                for cell in matrix["cells"]:
                    self.stdout.write(f"  {cell['workers']:>8} {cell['vendor_latency_s']:>10g} {_fmt(cell['throughput_tps']):>8} "
                                      f"{_fmt(cell['p95_wait_s']):>11} {cell['deadline_share']:>12.1%}")


def _fmt(value) -> str:
    if value is None:
        return "—"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _services_up() -> bool:
    import socket

    for port in (5432, 6379):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError:
            return False
    return True
