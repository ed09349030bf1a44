"""`python manage.py chaos [--tasks N] [--minutes M] [--seed S] [--json] [--keep]`: Sluice on
several namespaced hosts (tasks/hosts.py), a load with vendor faults, and host-level faults while
it runs: SIGKILL of worker-b's processes every 20 s, worker-a cut from the database and Redis
for 30 s while it holds leases, the web host cut from Redis, worker-a cut from the vendor, the
object store stalled. It ends with the POC invariants (tasks/poc/checks.py) as a table and as
the JSON of shared/contracts/chaos.md. Exit 0 passed, 1 an invariant failed, 2 not set up.

The parent builds the hosts (PostgreSQL + Redis on `db`, an S3 server on `store`) and tears them
down; a child process, whose database is the `db` host's, starts Sluice on the other hosts and
drives the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

FAULT_RATE = 0.2
TIME_SCALE = 0.2
BUCKET = "sluice-chaos"


def vendor_faults(rate: float) -> list[dict[str, Any]]:
    """Vendor faults at `rate` in all, spread over the kinds that matter for money and loss."""
    share = rate / 5
    return [
        {"id": "chaos-reset", "endpoint": "* *", "type": "reset", "probability": share},
        {"id": "chaos-lost", "endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "reset"},
         "probability": share * 2},
        {"id": "chaos-503", "endpoint": "* *", "type": "http_error", "params": {"status": 503}, "probability": share},
        {"id": "chaos-slow", "endpoint": "GET /v1/jobs/*", "type": "delay", "params": {"ms": 3000},
         "probability": share, "stack": True},
    ]


class Command(BaseCommand):
    help = "Run Sluice across namespaced hosts under partitions, kills and vendor faults; check the invariants."

    def add_arguments(self, parser):
        parser.add_argument("--tasks", type=int, default=500)
        parser.add_argument("--minutes", type=float, default=10.0, help="The longest the run may take.")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--keep", action="store_true", help="Keep the run directory (logs).")
        parser.add_argument("--_child", default=None, help=argparse_suppress())

    def handle(self, *args, **options):
        if options["_child"]:
            self._child(options)
            return
        if options["tasks"] <= 0 or options["minutes"] <= 0:
            raise CommandError("--tasks and --minutes must be positive", returncode=2)
        from tasks.hosts import Hosts, HostsUnavailable

        run_dir = Path(settings.DATA_DIR) / "chaos" / uuid.uuid4().hex[:8]
        try:
            hosts = Hosts(run_dir)
        except HostsUnavailable as exc:
            self.stderr.write(f"chaos: cannot set up the hosts: {exc}")
            sys.exit(2)
        code = 2
        try:
            database = hosts.start_database()
            store = hosts["store"]
            store.stack.spawn("moto", [sys.executable, "-m", "moto.server", "-H", store.address, "-p", "5000"])
            s3_url = f"http://{store.address}:5000"
            store.stack.wait_http(f"{s3_url}/moto-api/", name="moto")
            env = {**hosts.env(database), "SLUICE_STORAGE_URL": f"s3://{BUCKET}/run", "SLUICE_S3_ENDPOINT_URL": s3_url,
                   "AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos-secret", "SLUICE_LOCAL_ENGINE": "off",
                   "SLUICE_TIME_SCALE": str(TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05"}
            import boto3

            boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1", aws_access_key_id="chaos",
                         aws_secret_access_key="chaos-secret").create_bucket(Bucket=BUCKET)
            child_env = {**os.environ, **env, "SLUICE_DATA_DIR": str(run_dir / "data")}
            child_env.pop("PYTEST_VERSION", None)
            manage = str(Path(settings.BASE_DIR) / "manage.py")
            migrated = subprocess.run([sys.executable, manage, "migrate", "--noinput"], env=child_env,
                                      capture_output=True, text=True)
            if migrated.returncode != 0:
                raise CommandError(f"migrating the db host failed:\n{migrated.stderr[-2000:]}")
            (run_dir / "hosts.json").write_text(json.dumps({"hosts": hosts.describe(), "env": env}))
            report = run_dir / "report.json"
            child = subprocess.run([sys.executable, manage, "chaos", "--_child", str(run_dir),
                                    "--tasks", str(options["tasks"]), "--minutes", str(options["minutes"]),
                                    "--seed", str(options["seed"])], env=child_env)
            if not report.exists():
                raise CommandError(f"the run ended without a report (exit {child.returncode}); logs in {run_dir}")
            result = json.loads(report.read_text())
            self._print(result, as_json=options["json"])
            code = 0 if result["passed"] else 1
        finally:
            hosts.teardown()
            if not options["keep"] and code == 0:
                import shutil

                shutil.rmtree(run_dir, ignore_errors=True)
            elif code != 0:
                self.stderr.write(f"chaos: logs kept in {run_dir}")
        sys.exit(code)

    def _print(self, result: dict[str, Any], *, as_json: bool) -> None:
        if as_json:
            self.stdout.write(json.dumps(result))
            return
        self.stdout.write(f"chaos run: {result['tasks']} tasks, seed {result['seed']}, {result['wall_s']} s, "
                          f"hosts {', '.join(result['hosts'])}")
        for fault in result["faults"]:
            self.stdout.write(f"  fault  {json.dumps(fault)}")
        if result.get("restarts"):
            self.stdout.write(f"  worker processes restarted after exiting: {len(result['restarts'])}")
        for name in ("terminal", "lost", "undetected_duplicate_billing", "late_writes_attempted", "late_writes_accepted",
                     "budget_violations", "quota_violations", "digest_mismatches"):
            self.stdout.write(f"  {name:<30} {result[name]}")
        self.stdout.write(f"  by_state                       {result['by_state']}")
        self.stdout.write("PASSED" if result["passed"] else "FAILED")

    # --- the child: Sluice on the hosts, the load, the faults ------------------------------------------
    def _child(self, options: dict[str, Any]) -> None:
        from fakevendor.control import VendorControl
        from tasks.hosts import Hosts
        from tasks.poc import checks as C
        from tasks.poc.context import RunContext
        from tasks.poc.model import Action, Scenario, Submit
        from tasks.poc.runner import configure, execute

        run_dir = Path(options["_child"])
        desc = json.loads((run_dir / "hosts.json").read_text())
        hosts = Hosts(run_dir, attach=desc["hosts"])
        for host in hosts.hosts.values():
            host.stack.env.update(desc["env"])
        seed, tasks = options["seed"], options["tasks"]
        log: list[dict[str, Any]] = []
        restarts: list[dict[str, Any]] = []  # worker processes that exited and were started again
        started = time.monotonic()

        def at() -> float:
            return round(time.monotonic() - started, 1)

        def start_worker(name: str) -> None:
            stack = hosts[name].stack
            stack.start_dispatcher(f"{name}-dispatcher")
            stack.start_all_clusters(workers=2)

        supervised = ("worker-a", "worker-b")
        killing: set[str] = set()
        stop = threading.Event()
        processes_lock = threading.Lock()  # the supervisor and the killer never act on a host at once

        def supervise() -> None:
            """What systemd's Restart=always does on a real host: a process that exits is started again."""
            while not stop.wait(1.0):
                with processes_lock:
                    _restart_exited()

        def _restart_exited() -> None:
            for name in supervised:
                if name in killing:
                    continue
                stack = hosts[name].stack
                for process_name, managed in list(stack.processes.items()):
                    if managed.process.poll() is None:
                        continue
                    stack.processes.pop(process_name, None)
                    managed.log.close()
                    log.append({"kind": "restart", "host": name, "process": process_name, "at_s": at()})
                    if process_name.endswith("-dispatcher"):
                        stack.start_dispatcher(process_name)
                    elif process_name.startswith("cluster-"):
                        lane = process_name.removeprefix("cluster-")
                        stack.start_cluster(None if lane == "control" else lane, workers=2)

        next_kill = {"at": time.monotonic() + 20}

        def kill_due(ctx) -> bool:
            return time.monotonic() >= next_kill["at"]

        def kill_b(ctx) -> None:
            next_kill["at"] = time.monotonic() + 20
            with processes_lock:
                killing.add("worker-b")
                hosts["worker-b"].kill_all()
            log.append({"kind": "sigkill", "host": "worker-b", "at_s": at()})
            time.sleep(2)
            with processes_lock:
                start_worker("worker-b")
                killing.discard("worker-b")

        def partition(name: str, others: list[str], for_s: float):
            def do(ctx) -> None:
                entry = {"kind": "partition", "from": name, "to": others, "at_s": at(), "for_s": for_s}
                hosts.partition(name, others)
                time.sleep(for_s)
                hosts.heal(name)
                entry["healed_at_s"] = at()
                log.append(entry)
            return do

        def stall_store(ctx) -> None:
            pids = subprocess.run(["ip", "netns", "pids", hosts["store"].namespace], capture_output=True,
                                  text=True).stdout.split()
            entry = {"kind": "stall", "host": "store", "at_s": at(), "for_s": 8}
            for pid in pids:
                os.kill(int(pid), signal.SIGSTOP)
            time.sleep(8)
            for pid in pids:
                os.kill(int(pid), signal.SIGCONT)
            log.append(entry)

        nominal = 1 / TIME_SCALE
        scenario = Scenario(
            name="chaos", summary="hosts partitioned and killed under vendor faults",
            workload=[Submit(share=0.8), Submit(share=0.2, priority="batch")],
            tasks=tasks, time_scale=TIME_SCALE, budget_s=options["minutes"] * 60 * nominal,
            faults=vendor_faults(FAULT_RATE),
            vendor_channels={name: {"processing_ms": 1500, "queue_ms": 100} for name in ("primary", "fallback")},
            actions=[
                Action("kill worker-b every 20 s", kill_b, when=kill_due, repeat=True),
                Action("cut worker-a from db and redis", partition("worker-a", ["db", "redis"], 30), at_s=8 * nominal),
                Action("cut web from redis", partition("web", ["redis"], 15), at_s=45 * nominal),
                Action("cut worker-a from the vendor", partition("worker-a", ["vendor"], 10), at_s=65 * nominal),
                Action("stall the object store", stall_store, at_s=80 * nominal),
            ],
            checks=[C.exactly_one_terminal_state, C.slots_all_released],
        )
        vendor = hosts["vendor"].stack
        vendor_url = vendor.start_vendor(time_scale=TIME_SCALE, seed=seed, channels=scenario.vendor_channels)
        tokens = configure(scenario, vendor_url=vendor_url)
        web_url = hosts["web"].stack.start_web(workers=2, threads=8)
        start_worker("worker-a")
        start_worker("worker-b")
        ctx = RunContext(scenario=scenario, seed=seed, tasks=tasks, time_scale=TIME_SCALE, web_url=web_url,
                         vendor_url=vendor_url, control=VendorControl(vendor_url, hosts.admin_token), tokens=tokens,
                         stack=hosts["worker-a"].stack)
        supervisor = threading.Thread(target=supervise, daemon=True)
        supervisor.start()
        try:
            report = execute(ctx)
        finally:
            stop.set()
            supervisor.join(5)
            for host in hosts.hosts.values():
                if host.name not in ("db", "store"):
                    host.stack.stop_all()
        result = chaos_report(report, log, hosts=list(hosts.hosts), seed=seed, tasks=tasks, wall_s=at())
        result["restarts"] = restarts
        (run_dir / "report.json").write_text(json.dumps(result))


def chaos_report(report: dict[str, Any], faults: list[dict[str, Any]], *, hosts: list[str], seed: int, tasks: int,
                 wall_s: float) -> dict[str, Any]:
    """The POC report of the run as shared/contracts/chaos.md has it."""
    from tasks.models import Attempt, Task, TaskEvent

    observed = {r["name"]: r for r in report["invariants"]}

    def count(name: str) -> int:
        value = observed.get(name, {}).get("observed", 0)
        return value if isinstance(value, int) else len(value or [])

    states = report["metrics"].get("states", {})
    terminal = sum(n for s, n in states.items() if s in ("SUCCEEDED", "FAILED", "EXPIRED", "CANCELLED"))
    attempted = (Attempt.objects.filter(outcome=Attempt.Outcome.FENCED).count()
                 + TaskEvent.objects.filter(reason__startswith="late result discarded").count())
    result = {
        "seed": seed, "tasks": tasks, "wall_s": wall_s, "hosts": hosts,
        "faults": [*faults, {"kind": "vendor", "rate": FAULT_RATE}],
        "terminal": terminal, "by_state": states,
        "lost": count("lost_tasks"), "undetected_duplicate_billing": count("undetected_duplicate_billing"),
        "late_writes_attempted": attempted, "late_writes_accepted": count("late_writes_accepted"),
        "budget_violations": count("budget_violations"), "quota_violations": 0,
        # The result kept against what the vendor declared for the job it came from.
        "digest_mismatches": sum(
            1 for task in Task.objects.filter(state="SUCCEEDED").select_related("vendor_job")
            if task.vendor_job and task.vendor_job.result_sha256 and task.vendor_job.result_sha256 != task.result_sha256),
        "invariants": report["invariants"],
    }
    partitioned = any(f["kind"] == "partition" and f["from"].startswith("worker") for f in faults)
    result["passed"] = (terminal == tasks and all(result[k] == 0 for k in (
        "lost", "undetected_duplicate_billing", "late_writes_accepted", "budget_violations", "quota_violations",
        "digest_mismatches")) and (attempted > 0 or not partitioned))
    return result


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS
