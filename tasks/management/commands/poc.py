"""`python manage.py poc list` / `poc run NAME[,NAME...]|all [--seed N] [--tasks N] [--time-scale F] [--dialect D] [--json] [--live]`.

Each scenario runs in a child process against its own scratch database (a copy of a freshly
migrated template), with its own fake vendor, web server, dispatcher and clusters. Ctrl-C stops
everything the run started. Exit status: 0 all invariants hold, 1 some do not, 2 bad usage.
"""

from __future__ import annotations

import json
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tasks.poc.catalog import SCENARIOS, by_name
from tasks.poc.dialects import DIALECTS, for_dialect
from tasks.scratch import Scratch


class Command(BaseCommand):
    help = "Run proof-of-concept scenarios against the real system and the fake vendor; report a verdict."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="List the scenarios.")
        run = sub.add_parser("run", help="Run a scenario, several (comma-separated), or all.")
        run.add_argument("name", help="A scenario's name, several separated by commas, or all.")
        run.add_argument("--seed", type=int, default=7)
        run.add_argument("--tasks", type=int, default=None)
        run.add_argument("--time-scale", type=float, default=None)
        run.add_argument("--dialect", default="sluice", help=f"Vendor dialect: {', '.join(DIALECTS)} (default sluice).")
        run.add_argument("--json", action="store_true")
        run.add_argument("--live", action="store_true", help="Drive the running system instead of starting one.")
        run.add_argument("--keep", action="store_true", help="Keep the scratch data and logs.")
        run.add_argument("--report-file", default=None, help="Also write the JSON report here.")
        child = sub.add_parser("_child", help="(internal) run one scenario in this process")
        child.add_argument("name")
        child.add_argument("--seed", type=int, required=True)
        child.add_argument("--tasks", type=int, required=True)
        child.add_argument("--time-scale", type=float, required=True)
        child.add_argument("--workdir", required=True)
        child.add_argument("--report", required=True)
        child.add_argument("--quiet", action="store_true")
        child.add_argument("--dialect", default="sluice")

    def handle(self, *args, **options):
        action = options["action"]
        if action == "list":
            width = max(len(s.name) for s in SCENARIOS)
            for scenario in SCENARIOS:
                self.stdout.write(f"{scenario.name:<{width}}  [{', '.join(scenario.dialects)}]  {scenario.summary}")
            return
        if action == "_child":
            self._child(options)
            return
        self._run(options)

    # --- the parent -----------------------------------------------------------------------------
    def _run(self, options: dict[str, Any]) -> None:
        scenarios = by_name()
        name = options["name"]
        named = None if name == "all" else [part.strip() for part in name.split(",")]
        for part in named or []:
            if part not in scenarios:
                raise CommandError(f"unknown scenario {part!r}; known: all, {', '.join(scenarios)}", returncode=2)
        scale = options["time_scale"]
        if scale is not None and not 0 < scale <= 10:
            raise CommandError(f"--time-scale must be in (0, 10]; got {scale}", returncode=2)
        if options["tasks"] is not None and options["tasks"] <= 0:
            raise CommandError(f"--tasks must be a positive number; got {options['tasks']}", returncode=2)
        dialect = options["dialect"]
        if dialect not in DIALECTS:
            raise CommandError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}", returncode=2)
        chosen = list(scenarios.values()) if named is None else [scenarios[part] for part in dict.fromkeys(named)]
        for scenario in chosen if named else []:  # a scenario asked for by name runs or says why not
            if dialect not in scenario.dialects:
                raise CommandError(f"{scenario.name} does not apply to the {dialect} dialect (it is written for "
                                   f"{', '.join(scenario.dialects)})", returncode=2)
            if options["live"] and not scenario.live:
                raise CommandError(f"{scenario.name} controls processes (workers, broker) and cannot run --live",
                                   returncode=2)
        chosen = [s for s in chosen if dialect in s.dialects and (s.live or not options["live"])]
        reports = []
        run_dir = Path(settings.DATA_DIR) / "poc" / uuid.uuid4().hex[:8]
        scratch = Scratch(run_dir)
        try:
            if not options["live"]:
                scratch.prepare_template()
            for index, scenario in enumerate(chosen):
                tasks = options["tasks"] or scenario.tasks
                time_scale = scale or scenario.time_scale
                if options["live"]:
                    from tasks.poc.runner import run_live

                    report = run_live(for_dialect(scenario, dialect), seed=options["seed"], tasks=tasks,
                                      quiet=options["json"] and not sys.stderr.isatty())
                else:
                    report = scratch.run_child(scenario.name, index, seed=options["seed"], tasks=tasks,
                                               time_scale=time_scale, quiet=False, dialect=dialect)
                reports.append(report)
                if not options["json"]:
                    self._print_report(report)
        except KeyboardInterrupt:
            scratch.kill_leftovers()
            self.stderr.write("interrupted: every process the run started was stopped")
            sys.exit(130)
        finally:
            scratch.kill_leftovers()
            scratch.cleanup(keep=options["keep"])
        document = reports[0] if named and len(chosen) == 1 else reports
        if options["report_file"]:
            Path(options["report_file"]).write_text(json.dumps(document, indent=2))
        if options["json"]:
            self.stdout.write(json.dumps(document, indent=2))
        else:
            self._print_summary(reports)
        if not all(r.get("passed") for r in reports):
            sys.exit(1)

    def _print_report(self, report: dict[str, Any]) -> None:
        verdict = self.style.SUCCESS("PASS") if report.get("passed") else self.style.ERROR("FAIL")
        self.stdout.write(f"\n{report['scenario']}  {verdict}  ({report.get('duration_s', 0)}s, {report.get('tasks')} tasks, "
                          f"time scale {report.get('time_scale')}, dialect {report.get('dialect', 'sluice')})")
        if "error" in report:
            self.stdout.write(f"  error: {report['error']}")
        for inv in report.get("invariants", []):
            mark = "ok  " if inv["ok"] else "FAIL"
            detail = f"  — {inv['detail']}" if inv.get("detail") else ""
            self.stdout.write(f"  {mark} {inv['name']:<40} observed {json.dumps(inv['observed'])}  expected {inv['expected']}{detail}")
        metrics = report.get("metrics", {})
        shown = {k: v for k, v in metrics.items() if not k.startswith("_") and k != "states"}
        self.stdout.write(f"  states {metrics.get('states')}  metrics {json.dumps(shown, default=str)}")

    def _print_summary(self, reports: list[dict[str, Any]]) -> None:
        if len(reports) < 2:
            return
        self.stdout.write("\nscenario                     result  duration  invariants")
        for r in reports:
            invariants = r.get("invariants", [])
            ok = sum(1 for i in invariants if i["ok"])
            verdict = "PASS" if r.get("passed") else "FAIL"
            self.stdout.write(f"{r['scenario']:<28} {verdict:<7} {r.get('duration_s', 0):>7}s  {ok}/{len(invariants)}")

    # --- the child -------------------------------------------------------------------------------
    def _child(self, options: dict[str, Any]) -> None:
        from tasks.poc.runner import run_isolated

        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        scenario = for_dialect(by_name()[options["name"]], options["dialect"])
        workdir = Path(options["workdir"])
        try:
            report = run_isolated(scenario, seed=options["seed"], tasks=options["tasks"], time_scale=options["time_scale"],
                                  workdir=workdir, quiet=options["quiet"])
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            import traceback

            traceback.print_exc()
            report = {"scenario": scenario.name, "seed": options["seed"], "tasks": options["tasks"],
                      "time_scale": options["time_scale"], "passed": False, "duration_s": 0,
                      "error": f"{type(exc).__name__}: {exc}", "invariants": [], "metrics": {}}
        Path(options["report"]).write_text(json.dumps(report, default=str))
