"""The QA command: usage errors, the JSON report, a broken guarantee caught, Ctrl-C cleanup."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = [pytest.mark.slow, pytest.mark.once]  # the scenarios themselves run on every setup
MANAGE = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "poc"]


def run(*args, env=None, timeout=600):
    return subprocess.run([*MANAGE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=settings.BASE_DIR)


def test_list_names_every_contract_scenario():
    names = {line.split()[0] for line in run("list").stdout.splitlines() if line.strip()}
    assert names >= {"delivery-interrupted", "mixed-load", "timeout-cancel-worker-lost", "corrupt-file",
                     "big-upload-timeout", "reset-mid-upload", "response-lost", "ignore-idempotency",
                     "rate-limit-storm", "vendor-outage-fallback", "poll-storm", "retry-herd", "cancel-race",
                     "no-reconcile-handle", "vendor-amnesia", "result-rate-limited", "garbled-response",
                     "dual-outage-wait", "goaway-mid-poll", "converter-budget"}


@pytest.mark.parametrize("args,needle", [
    (["run", "no-such-scenario"], "known: all, delivery-interrupted"),
    (["run", "all", "--time-scale", "0"], "--time-scale must be in (0, 10]"),
    (["run", "all", "--time-scale", "11"], "--time-scale must be in (0, 10]"),
    (["run", "response-lost", "--tasks", "-3"], "--tasks must be a positive number"),
    (["run", "response-lost", "--dialect", "smoke-signals"], "unknown dialect 'smoke-signals'"),
    (["run", "ignore-idempotency", "--dialect", "assemblyai"], "does not apply to the assemblyai dialect"),
    (["run", "response-lost,no-such-scenario"], "unknown scenario 'no-such-scenario'"),
    (["run", "response-lost,"], "unknown scenario ''"),
    (["run", "response-lost,ignore-idempotency", "--dialect", "assemblyai"],
     "ignore-idempotency does not apply to the assemblyai dialect"),
    (["run", "response-lost,zombie-worker", "--live"], "zombie-worker controls processes"),
])
def test_bad_usage_exits_2_with_the_reason(args, needle):
    done = run(*args)
    assert done.returncode == 2 and needle in done.stderr


def test_a_run_prints_one_json_document_and_exits_0_when_every_invariant_holds():
    done = run("run", "response-lost", "--tasks", "8", "--json", "--seed", "3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["scenario"] == "response-lost" and report["seed"] == 3 and report["tasks"] == 8
    assert report["passed"] is True and report["duration_s"] > 0
    names = {i["name"] for i in report["invariants"]}
    assert {"lost_tasks", "undetected_duplicate_billing", "budget_violations", "late_writes_accepted",
            "secrets_in_logs"} <= names
    assert all({"name", "ok", "observed", "expected"} <= set(i) for i in report["invariants"])
    assert report["metrics"]["vendor_jobs_billed"] == 8


def test_scenarios_named_together_run_in_turn_and_report_as_a_list():
    done = run("run", "cancel-race,response-lost", "--tasks", "8", "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = json.loads(done.stdout)
    assert [r["scenario"] for r in reports] == ["cancel-race", "response-lost"]
    assert all(r["passed"] and r["tasks"] == 8 for r in reports)


def test_breaking_reconciliation_on_purpose_fails_the_matching_scenario_and_says_why():
    done = run("run", "response-lost", "--tasks", "12", "--json", env={"SLUICE_UNSAFE_SKIP_RECONCILIATION": "1"})
    assert done.returncode == 1
    report = json.loads(done.stdout)
    failed = {i["name"]: i for i in report["invariants"] if not i["ok"]}
    assert "one_billed_job_per_task" in failed or "lost_responses_adopted" in failed, failed
    billed = failed.get("one_billed_job_per_task", {}).get("observed")
    assert billed is None or billed > 12


def test_ctrl_c_stops_everything_the_run_started():
    before = set(Path(settings.DATA_DIR, "poc").glob("*")) if Path(settings.DATA_DIR, "poc").exists() else set()
    # At time scale 1 the vendor's jobs take five real minutes: the run is surely still going when
    # interrupted. SIGINT is given its default disposition, as in a terminal's foreground job (a
    # shell's background job, e.g. a CI step run with `&`, starts with it ignored).
    process = subprocess.Popen([*MANAGE, "run", "poll-storm", "--tasks", "6", "--time-scale", "1"], cwd=settings.BASE_DIR,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(pids) < 4:
            runs = set(Path(settings.DATA_DIR, "poc").glob("*")) - before
            pids = [int(p) for run_dir in runs for f in run_dir.glob("*/logs/pids.txt") for p in f.read_text().split()]
            time.sleep(0.2)
        assert len(pids) >= 4, "the run never started its processes"
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert process.wait(timeout=60) == 130
        time.sleep(0.5)
        alive = [pid for pid in pids if _running(pid)]
        assert alive == [], f"processes left behind: {[(p, _describe(p)) for p in alive]}"
    finally:
        # Whatever the outcome, nothing of this run outlives the test.
        for group in [process.pid, *pids]:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120]
    except FileNotFoundError:
        return "?"
