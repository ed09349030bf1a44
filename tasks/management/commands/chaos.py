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
import socket
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
        if result.get("faults_not_applied"):
            self.stdout.write(f"  faults that never happened: {', '.join(result['faults_not_applied'])}")
        if result.get("restarts"):
            self.stdout.write(f"  worker processes restarted after exiting: {len(result['restarts'])}")
        for name in ("terminal", "lost", "undetected_duplicate_billing", "late_writes_attempted", "late_writes_accepted",
                     "budget_violations", "quota_violations", "digest_mismatches"):
            self.stdout.write(f"  {name:<30} {result[name]}")
        self.stdout.write(f"  by_state                       {result['by_state']}")
        if result.get("not_succeeded"):
            self.stdout.write(f"  not succeeded, why             {result['not_succeeded']}")
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
                    restarts.append({"host": name, "process": process_name, "at_s": at()})
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
            # At a moment it is working if one comes soon: a kill between steps tests less.
            busy_by = time.monotonic() + 5
            while not held_by("worker-b") and time.monotonic() < busy_by:
                time.sleep(0.05)
            with processes_lock:
                killing.add("worker-b")
                caught = held_by("worker-b")
                hosts["worker-b"].kill_all()
            entry = {"kind": "sigkill", "host": "worker-b", "at_s": at(), "_start": time.time(), "_caught": caught}
            time.sleep(2)
            with processes_lock:
                start_worker("worker-b")
                killing.discard("worker-b")
            entry["_end"] = time.time()  # its processes run again
            log.append(entry)

        applied: dict[str, threading.Event] = {}  # each host-level fault, set once it has ended

        def fault(name: str, do):
            applied[name] = threading.Event()

            def run(ctx) -> None:
                do()  # if it raised, the action runs again; the fault counts once it has happened
                applied[name].set()
            return run

        def partition(name: str, others: list[str], for_s: float):
            def do() -> None:
                entry = {"kind": "partition", "from": name, "to": others, "at_s": at(), "for_s": for_s,
                         "_start": time.time(), "_caught": held_by(name) if name.startswith("worker") else None}
                hosts.partition(name, others)
                time.sleep(for_s)
                hosts.heal(name)
                entry["healed_at_s"], entry["_end"] = at(), time.time()
                log.append(entry)
            return do

        def stall_store() -> None:
            pids = namespace_pids("store")
            from tasks.models import Task

            running = [str(pk) for pk in Task.objects.filter(state="RUNNING").values_list("pk", flat=True)]
            entry = {"kind": "stall", "host": "store", "at_s": at(), "for_s": 8, "_start": time.time(), "_caught": running}
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(8)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            entry["_end"] = time.time()
            log.append(entry)

        def namespace_pids(name: str) -> list[int]:
            out = subprocess.run(["ip", "netns", "pids", hosts[name].namespace], capture_output=True, text=True).stdout
            return [int(pid) for pid in out.split()]

        checked: dict[str, float] = {}

        def held_by(name: str) -> list[str]:
            """The tasks whose lease a process of this host holds now."""
            from tasks.models import Task

            owners = [f"{socket.gethostname()}:{pid}" for pid in namespace_pids(name)]
            return [str(pk) for pk in Task.objects.filter(lease_owner__in=owners, lease_expires_at__isnull=False)
                    .values_list("pk", flat=True)]

        def leases_held(name: str, *phases: str) -> bool:
            """Whether a process of this host holds a task's lease (in one of these phases); asked
            at most four times a second per question."""
            from tasks.models import Task

            key = f"{name}:{phases}"
            if time.monotonic() - checked.get(key, 0.0) < 0.25:
                return False
            checked[key] = time.monotonic()
            owners = [f"{socket.gethostname()}:{pid}" for pid in namespace_pids(name)]
            held = Task.objects.filter(lease_owner__in=owners, lease_expires_at__isnull=False)
            return (held.filter(phase__in=phases) if phases else held).exists()

        def terminal_share(ctx) -> float:
            from tasks.models import Task

            return Task.objects.filter(state__in=TERMINAL).count() / max(tasks, 1)

        cut_vendor = fault("worker-a from the vendor", partition("worker-a", ["vendor"], 10))
        cut_db = fault("worker-a from db and redis", partition("worker-a", ["db", "redis"], 30))
        cut_web = fault("web from redis", partition("web", ["redis"], 15))
        stall = fault("store stalled", stall_store)

        def all_faults_applied(ctx) -> None:
            """Before the tail's tasks: every host fault has happened and healed (or the budget ran out),
            so the run ends only after late writes could be attempted and healed hosts worked again."""
            deadline = time.monotonic() + options["minutes"] * 60
            for event in applied.values():
                event.wait(max(deadline - time.monotonic(), 0))

        nominal = 1 / TIME_SCALE
        tail = max(tasks // 10, 1)
        scenario = Scenario(
            name="chaos", summary="hosts partitioned and killed under vendor faults",
            # Mostly batch work, as a load of this size is: interactive tasks that cannot start within
            # their queue deadline (300 s nominal, 60 s here) expire by design, and would not be run.
            workload=[Submit(share=0.15), Submit(share=0.85, priority="batch"), Submit(count=tail, phase="tail")],
            phases=("main", "tail"),
            tasks=tasks, time_scale=TIME_SCALE, budget_s=options["minutes"] * 60 * nominal,
            faults=vendor_faults(FAULT_RATE),
            vendor_channels={name: {"processing_ms": 1500, "queue_ms": 100} for name in ("primary", "fallback")},
            actions=[
                Action("kill worker-b every 20 s", kill_b, when=kill_due, repeat=True),
                # Intake while the web host cannot reach Redis: it must still answer 202, durably.
                Action("cut web from redis", cut_web, at_s=0),
                # Mid-upload or mid-create: the ambiguous calls are reconciled.
                Action("cut worker-a from the vendor", cut_vendor,
                       when=lambda ctx: leases_held("worker-a", "upload", "create")),
                # While it holds leases, once it reaches the vendor again: they expire, worker-b takes
                # over, and every write worker-a attempts after healing is refused by fencing.
                Action("cut worker-a from db and redis", cut_db,
                       when=lambda ctx: applied["worker-a from the vendor"].is_set() and leases_held("worker-a")),
                Action("stall the object store", stall, when=lambda ctx: terminal_share(ctx) >= 0.2),
                Action("wait for every host fault", all_faults_applied, before_phase="tail"),
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
        result["faults_not_applied"] = sorted(name for name, event in applied.items() if not event.is_set())
        if not any(f["kind"] == "sigkill" for f in log):
            result["faults_not_applied"].append("kill worker-b")
        result["passed"] = result["passed"] and not result["faults_not_applied"]
        (run_dir / "report.json").write_text(json.dumps(result))


def chaos_report(report: dict[str, Any], faults: list[dict[str, Any]], *, hosts: list[str], seed: int, tasks: int,
                 wall_s: float) -> dict[str, Any]:
    """The POC report of the run as shared/contracts/chaos.md has it."""
    from django.db.models import Count

    from tasks.models import Attempt, Task, TaskEvent

    observed = {r["name"]: r for r in report["invariants"]}

    def count(name: str) -> int:
        value = observed.get(name, {}).get("observed", 0)
        return value if isinstance(value, int) else len(value or [])

    history = list(TaskEvent.objects.exclude(to_state="").values_list("task_id", "to_state", "at"))
    events = [(str(task_id), state, at.timestamp()) for task_id, state, at in history]
    faults = [{**{k: v for k, v in f.items() if not k.startswith("_")}, **recovery(f, events)} for f in faults]
    states = report["metrics"].get("states", {})
    terminal = sum(n for s, n in states.items() if s in ("SUCCEEDED", "FAILED", "EXPIRED", "CANCELLED"))
    attempted = (Attempt.objects.filter(outcome=Attempt.Outcome.FENCED).count()
                 + TaskEvent.objects.filter(reason__startswith="late result discarded").count())
    result = {
        "seed": seed, "tasks": tasks, "wall_s": wall_s, "hosts": hosts,
        "faults": [*faults, {"kind": "vendor", "rate": FAULT_RATE}],
        "terminal": terminal, "by_state": states,
        # Why the tasks that did not succeed ended as they did (a deadline, a vendor refusal...).
        "not_succeeded": {f"{state} {code or '-'} ({lane or 'no lane'})": n for state, code, lane, n in
                          Task.objects.exclude(state="SUCCEEDED").values_list("state", "error_code", "lane_id")
                          .annotate(n=Count("pk")).order_by("state", "error_code", "lane_id")},
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


TERMINAL = ("SUCCEEDED", "FAILED", "EXPIRED", "CANCELLED")
def recovery(fault: dict[str, Any], events: list[tuple[str, str, float]]) -> dict[str, Any]:
    """The tasks a fault caught and how long after it they moved on: those whose lease the host
    held (a kill, a worker's partition), those running when the store stalled, those accepted
    while the web host was cut off (their first trigger lost)."""
    if "_start" not in fault:
        return {}
    start, end = fault["_start"], fault["_end"]
    if fault.get("_caught") is not None:
        caught = {task_id: start for task_id in fault["_caught"]}
    else:
        caught = {task_id: at_s for task_id, state, at_s in events if state == "ACCEPTED" and start <= at_s <= end}
    return {"tasks_caught": len(caught), "recovered_after_s": recovery_after_s(end, caught, events)}


def recovery_after_s(end: float, caught: dict[str, float], events: list[tuple[str, str, float]]) -> float | None:
    """Seconds from a fault's end until every task it caught (each from the moment it was caught)
    had changed state again — 0 when all did during the fault (another host took over) — or
    None when one never did."""
    moved: dict[str, float] = {}
    for task_id, _state, at_s in sorted(events, key=lambda e: e[2]):
        if task_id in caught and task_id not in moved and at_s > caught[task_id]:
            moved[task_id] = at_s
    if any(task_id not in moved for task_id in caught):
        return None
    return round(max([moved[t] - end for t in caught] + [0.0]), 1)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS
