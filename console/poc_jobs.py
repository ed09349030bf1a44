"""Running a POC scenario in the background for the console (control cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from console.models import PocRun


def run_poc(run_id: int) -> str:
    run = PocRun.objects.get(pk=run_id)
    PocRun.objects.filter(pk=run.pk).update(status=PocRun.Status.RUNNING, progress="starting")
    report_file = Path(tempfile.mkdtemp(dir=settings.DATA_DIR)) / "report.json"
    command = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "poc", "run", run.scenario,
               "--seed", str(run.seed), "--json", "--report-file", str(report_file)]
    if run.tasks:
        command += ["--tasks", str(run.tasks)]
    if run.time_scale:
        command += ["--time-scale", str(run.time_scale)]
    if run.live:
        command += ["--live"]
    process = subprocess.Popen(command, cwd=settings.BASE_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last_saved = 0.0
    buffer = b""
    while True:
        chunk = process.stderr.read1(4096) if hasattr(process.stderr, "read1") else process.stderr.read(4096)
        if not chunk:
            break
        buffer = (buffer + chunk)[-4096:]
        if time.monotonic() - last_saved > 1:
            line = buffer.replace(b"\x1b[K", b"").split(b"\r")[-1].split(b"\n")[-1].decode(errors="replace")
            PocRun.objects.filter(pk=run.pk).update(progress=line[:300])
            last_saved = time.monotonic()
    process.wait()
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    reports = report if isinstance(report, list) else [report] if report else []
    if report is None:
        status = PocRun.Status.ERROR
    else:
        status = PocRun.Status.PASSED if all(r.get("passed") for r in reports) else PocRun.Status.FAILED
    PocRun.objects.filter(pk=run.pk).update(status=status, report=report, finished_at=timezone.now(),
                                            progress=f"exit {process.returncode}")
    return status
