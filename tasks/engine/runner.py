"""One conversion, in its own process: `python -m tasks.engine.runner JOB_DIR`.

Started detached by the local adapter (it outlives the worker step that created it, like a job at
a vendor), it converts the job's input under the job's budget and writes the job's status:

- every converter command runs in its own process group with CPU seconds, address space and
  output file size limits, a wall clock, a private temporary directory and LibreOffice profile
  (`-env:UserInstallation`), and no network (a new network namespace, when running as root);
- on any limit the whole group is killed, and the job fails with engine_timeout,
  engine_cpu_exceeded, engine_out_of_memory, output_too_large or engine_crashed;
- the temporary directory and the profile are removed whatever happened.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tasks import engine
from tasks.engine import ConversionFailed

CONTENT_TYPES = {"pdf": "application/pdf", "html": "text/html", "txt": "text/plain", "md": "text/markdown"}
OFFICE_FILTERS = {"pdf": "pdf", "html": "html", "txt": "txt:Text (encoded):UTF8"}
# Test documents may carry these markers to stand for a document that hangs or eats the engine
# (only where the job's request allows it: tests).
WARM_CRASH_MARKER = b"SLUICE-ENGINE-WARM-CRASH"  # the warm converter fails on it, a fresh one does not
TEST_MARKERS = {b"SLUICE-ENGINE-LOOP": "loop", b"SLUICE-ENGINE-ALLOCATE": "allocate", b"SLUICE-ENGINE-CRASH": "crash"}


def write_status(job_dir: Path, **status: Any) -> None:
    """Atomically: a reader sees the old status or the new one, never half."""
    path = job_dir / "status.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(status)
    temp = job_dir / f".status.{os.getpid()}.tmp"
    temp.write_text(json.dumps(current))
    os.replace(temp, path)


def _limits(cpu_s: int, memory_mb: int, output_mb: int):
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 2))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _isolated(command: list[str]) -> list[str]:
    """No network for the converter: its own network namespace where we may create one."""
    if os.geteuid() == 0 and shutil.which("unshare"):
        return ["unshare", "--net", "--", *command]
    return command


def run_limited(command: list[str], *, limits: dict[str, int], deadline: float, tmp: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "TMPDIR": str(tmp), "LANG": "C.UTF-8",
           "SAL_USE_VCLPLUGIN": "svp"}
    process = subprocess.Popen(_isolated(command), cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT,
                               preexec_fn=_limits(limits["cpu_s"], limits["memory_mb"], limits["output_mb"]))
    if _job_dir is not None:  # a cancel kills the converter's group too
        write_status(_job_dir, child_pid=process.pid)
    try:
        output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        process.communicate()
        raise ConversionFailed("engine_timeout", f"the conversion took longer than its {limits['wall_s']} s") from None
    finally:
        _kill_group(process.pid)  # helpers it left behind (soffice.bin, oosplash) go with it
    code = process.returncode
    text = (output or b"")[-2000:].decode(errors="replace")
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft, then the hard CPU limit (the wall clock is handled above)
        raise ConversionFailed("engine_cpu_exceeded", f"the conversion used more than {limits['cpu_s']} CPU seconds")
    if code == -signal.SIGXFSZ:
        raise ConversionFailed("output_too_large", f"the output grew past {limits['output_mb']} MB")
    if "bad_alloc" in text or "MemoryError" in text or "Cannot allocate memory" in text or "out of memory" in text.lower():
        raise ConversionFailed("engine_out_of_memory", f"the conversion needed more than {limits['memory_mb']} MB")
    if code != 0:
        raise ConversionFailed("engine_crashed", f"the converter exited with {code}")
    return subprocess.CompletedProcess(command, code, output, b"")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _test_command(kind: str) -> list[str]:
    code = {"loop": "while True: pass",
            "allocate": "b = []\nwhile True: b.append(bytearray(64 * 1024 * 1024))",
            "crash": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"}[kind]
    return [sys.executable, "-c", code]


def convert(request: dict[str, Any], job_dir: Path) -> Path:
    source = Path(request["input"])
    extension, target = request["extension"], request["target"]
    steps = engine.plan(extension, target)
    if steps is None:
        raise ConversionFailed("unsupported_conversion", f"the engine cannot convert .{extension} to {target}")
    limits = request["limits"]
    deadline = time.monotonic() + limits["wall_s"]
    tmp = job_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    work = tmp / f"input.{extension}"
    shutil.copyfile(source, work)
    warm_breaks = False
    if request.get("test_markers"):
        head = work.read_bytes()[:1 << 20]
        for marker, kind in TEST_MARKERS.items():
            if marker in head:
                run_limited(_test_command(kind), limits=limits, deadline=deadline, tmp=tmp)
        warm_breaks = WARM_CRASH_MARKER in head
    current = work
    for step in steps:
        if step.startswith("office-") and request.get("warm"):
            from tasks.engine import warm

            settings = request["warm"]
            fmt = step.split("-", 1)[1]
            dest = tmp / f"out-warm.{fmt}"
            try:
                if warm_breaks:
                    raise ConversionFailed("engine_crashed", "the warm converter failed (test marker)")
                converted = warm.convert(current, dest, extension=extension, root=job_dir.parent.parent,
                                         lane=settings["lane"], pool=settings["pool"], limits=limits,
                                         recycle_after=settings["recycle_after"], idle_s=settings["idle_s"],
                                         deadline=deadline, fmt=fmt)
            except ConversionFailed as failed:
                if failed.code == "engine_timeout":
                    raise  # the job's wall clock is spent
                # A long-running instance may be what broke (its state, not the document): the
                # document gets a fresh LibreOffice of its own before it is called a failure.
                converted = None
                request["_warm_failed"] = failed.code
                dest.unlink(missing_ok=True)
            if converted:
                current = dest
                request["_converter"] = "warm"
                request["_warm_instance"] = converted
                continue
        current = _step(step, current, target, limits=limits, deadline=deadline, tmp=tmp)
    if target == "pdf" and not current.read_bytes()[:5] == b"%PDF-":
        raise ConversionFailed("engine_crashed", "the engine wrote something that is not a PDF")
    result = job_dir / f"result.{target}"
    os.replace(current, result)
    return result


def _step(step: str, source: Path, target: str, *, limits: dict[str, int], deadline: float, tmp: Path) -> Path:
    if step == "copy":
        if source.read_bytes()[:5] != b"%PDF-":
            raise ConversionFailed("engine_input_invalid", "the file is not a PDF")
        return source
    if step.startswith("office-"):
        fmt = step.split("-", 1)[1]
        out = tmp / f"out-{fmt}"
        out.mkdir(exist_ok=True)
        profile = tmp / "profile"
        try:
            run_limited([engine.soffice(), "--headless", "--norestore", "--nolockcheck", "--nodefault", "--nologo",
                         f"-env:UserInstallation=file://{profile}", "--convert-to", OFFICE_FILTERS[fmt], "--outdir",
                         str(out), str(source)], limits=limits, deadline=deadline, tmp=tmp)
        finally:
            engine.remove_pipes(profile)  # a LibreOffice killed at a limit leaves its pipe in /tmp
        produced = sorted(out.iterdir())
        if not produced:
            raise ConversionFailed("engine_crashed", "LibreOffice ended without writing the result")
        return produced[0]
    if step == "pdf-txt":
        out = tmp / "out.txt"
        run_limited(["pdftotext", "-enc", "UTF-8", "-layout", str(source), str(out)], limits=limits, deadline=deadline, tmp=tmp)
        return out
    if step == "pdf-html":
        out = tmp / "out.html"
        run_limited(["pdftohtml", "-s", "-i", "-noframes", "-q", str(source), str(out)], limits=limits, deadline=deadline, tmp=tmp)
        return out
    raise ConversionFailed("unsupported_conversion", f"unknown step {step}")


_job_dir: Path | None = None


def run(job_dir: Path) -> None:
    global _job_dir
    _job_dir = job_dir
    request = json.loads((job_dir / "request.json").read_text())
    status = json.loads((job_dir / "status.json").read_text()) if (job_dir / "status.json").exists() else {}
    if status.get("status") in ("completed", "failed", "canceled"):
        return
    write_status(job_dir, status="processing", pid=os.getpid(), started_at=time.time())
    try:
        result = convert(request, job_dir)
    except ConversionFailed as failure:
        outcome = {"status": "failed", "error_code": failure.code, "error_message": failure.message}
    except Exception as exc:  # the job must end, whatever broke
        outcome = {"status": "failed", "error_code": "engine_crashed", "error_message": type(exc).__name__}
    else:
        digest = hashlib.sha256()
        with open(result, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        outcome = {"status": "completed", "result": result.name, "sha256": digest.hexdigest(),
                   "size": result.stat().st_size, "content_type": CONTENT_TYPES[request["target"]],
                   "converter": request.get("_converter", "cold"),
                   **({"warm_instance": request["_warm_instance"]} if request.get("_warm_instance") else {}),
                   **({"warm_failed": request["_warm_failed"]} if request.get("_warm_failed") else {})}
    finally:
        # Before the final status: whoever sees the job ended sees its temporary files gone.
        shutil.rmtree(job_dir / "tmp", ignore_errors=True)
    if not _cancelled(job_dir):  # a cancel's "canceled" stands (the kill is why the step failed)
        write_status(job_dir, **outcome, finished_at=time.time())


def _cancelled(job_dir: Path) -> bool:
    """A cancel came while converting: its "canceled" stands (the kill is why the step failed)."""
    try:
        return json.loads((job_dir / "status.json").read_text()).get("status") == "canceled"
    except (OSError, ValueError):
        return False


def main() -> None:
    job_dir = Path(sys.argv[1])
    engine.daemonize()
    run(job_dir)
    os._exit(0)


if __name__ == "__main__":
    main()
