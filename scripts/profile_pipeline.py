"""Where a pipeline run's CPU goes: `make profile` runs the benchmark's pipeline section (150 tasks,
embedded setup) under py-spy, following every process it starts, and prints the share of samples
per kind of process and the functions of Sluice that hold the most of them.

    python scripts/profile_pipeline.py [--setup sqlite|postgres_redis] [--rate 50] [--seconds 25] [--raw FILE]
    python scripts/profile_pipeline.py --summarise FILE   # an earlier recording

py-spy samples the processes from outside (no code is changed, and `--nonblocking` never pauses
them); it samples only threads holding the GIL (`--gil`: Python running). Without it, the
recordings here counted sleeping threads as running (the web's cost-counting flusher, asleep,
held a third of its samples). The recording starts once the pipeline's tasks are being
submitted. The CPU each process used is counted by the benchmark itself (`pipeline_cpu_ms_per_task`).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = re.compile(r"\((tasks|console|fakevendor)/")


def record(setup: str, rate: int, seconds: int, raw: Path) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    log = raw.with_suffix(".bench.log")
    with open(log, "w") as out:
        bench = subprocess.Popen([sys.executable, "manage.py", "bench", "--setup", setup, "--only", "pipeline"],
                                 cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        child = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (child is None or "pipeline:" not in log.read_text()):
            found = subprocess.run(["pgrep", "-f", "bench --_child"], capture_output=True, text=True).stdout.split()
            child = child or (found[0] if found else None)
            time.sleep(0.2)
        if child is None:
            sys.exit(f"the benchmark did not start (see {log})")
        subprocess.run([spy, "record", "--gil", "--subprocesses", "--nonblocking", "-r", str(rate), "-d", str(seconds),
                        "-f", "raw", "-o", str(raw), "-p", child], check=True, capture_output=True)
        bench.wait(timeout=600)
    finally:
        if bench.poll() is None:
            bench.terminate()
    print(f"recorded {raw}; the benchmark said:")
    print("\n".join(line for line in log.read_text().splitlines() if "pipeline (" in line or "per task" in line))


def role(process: str, stack: str) -> str:
    if "dispatcher" in process:
        return "dispatcher"
    if "gunicorn" in process:
        return "web (intake)"
    if "fakevendor" in process:
        return "fake vendor"
    if "qcluster" in process:
        return "workers (steps)" if "run_step" in stack or "entry_point" in stack else "worker clusters (broker, monitor)"
    return "benchmark client"


def summarise(raw: Path, *, top: int = 12) -> str:
    shares: collections.Counter[str] = collections.Counter()
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        last = max(i for i, frame in enumerate(frames) if frame.startswith("process "))
        body = frames[last + 1:]
        kind = role(frames[last], ";".join(body))
        samples = int(count)
        shares[kind] += samples
        for name in {re.sub(r":\d+\)$", ")", frame) for frame in body if OURS.search(frame)}:
            functions[kind][name] += samples
    total = sum(shares.values()) or 1
    out = [f"{sum(shares.values())} samples", "", "| process | share of CPU samples |", "|---|---|"]
    out += [f"| {kind} | {100 * n / total:.0f} % |" for kind, n in shares.most_common()]
    for kind in ("workers (steps)", "web (intake)", "dispatcher"):
        if not functions[kind]:
            continue
        out += ["", f"{kind}: Sluice functions holding the most samples (inclusive, share of that process kind)", ""]
        out += [f"- {100 * n / shares[kind]:.0f} % {name}" for name, n in functions[kind].most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", default="sqlite", choices=("sqlite", "postgres_redis"))
    parser.add_argument("--rate", type=int, default=50, help="samples per second and process")
    parser.add_argument("--seconds", type=int, default=25)
    parser.add_argument("--raw", type=Path, help="where to keep the recording")
    parser.add_argument("--summarise", type=Path, help="summarise an earlier recording instead")
    args = parser.parse_args()
    if args.summarise:
        print(summarise(args.summarise))
        return
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    raw = args.raw or Path(tempfile.mkdtemp(prefix="sluice-profile-")) / "pipeline.raw"
    record(args.setup, args.rate, args.seconds, raw)
    print(summarise(raw))


if __name__ == "__main__":
    main()
