"""A dispatcher that stops moving work says so when it is back: how long every retry falling due
and every admission waited for it. A real dispatcher process, frozen as a paused VM or a starved
process would be (SIGSTOP), and the POC's evidence reading the pause from its log."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.conftest import TEST_TIME_SCALE, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
FROZEN_S = 2.0


def test_a_dispatcher_frozen_for_two_seconds_logs_a_pause_that_long_once_it_runs_again(tmp_path):
    from tasks.poc.context import RunContext
    from tasks.poc.evidence import Evidence
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    log = tmp_path / "s" / "dispatcher.log"
    try:
        stack.start_dispatcher()
        process = stack.processes["dispatcher"].process
        wait_for(lambda: '"dispatcher_started"' in log.read_text(), timeout=60, message="the dispatcher's start")
        time.sleep(0.5)
        os.kill(process.pid, signal.SIGSTOP)
        time.sleep(FROZEN_S)
        os.kill(process.pid, signal.SIGCONT)
        wait_for(lambda: '"dispatcher_paused"' in log.read_text(), timeout=30, message="the pause logged")
    finally:
        stack.stop_all()
    pauses = [json.loads(line) for line in log.read_text().splitlines() if '"dispatcher_paused"' in line]
    longest = max(p["duration_ms"] for p in pauses)
    assert FROZEN_S * 1000 <= longest < 30_000
    assert all(p["level"] == "WARNING" for p in pauses)

    # The POC's evidence reads the same pause, in real seconds, from the run's logs.
    ctx = RunContext.__new__(RunContext)
    ctx.started_at = time.time() - 600
    evidence = Evidence.__new__(Evidence)
    evidence.ctx, evidence.log_files = ctx, [tmp_path / "not-there.log", log]  # a missing file is skipped
    assert max(evidence.dispatcher_pauses_s()) == longest / 1000
    ctx.started_at = time.time()  # a pause from before the run is not the run's
    assert evidence.dispatcher_pauses_s() == []
