"""The `local` dialect: Sluice's own conversion engine behind the adapter seam (no HTTP).

A job is a directory under SLUICE_DATA_DIR/engine/jobs/ holding the request, the status the
converter process writes (tasks/engine/runner.py) and the result. Creating a job starts that
process detached, so the job lives on like a vendor's when the worker step that created it ends;
the job id derives from the operation's idempotency key, so a create sent twice is one job. The
engine honours the key, lists jobs by client_ref, stops a running conversion, vouches for its
results with a digest and bills nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks import engine
from tasks.models import VendorChannel
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.classification import classify_status
from tasks.vendors.errors import VendorError
from tasks.vendors.protocol import (
    BillingPage,
    CallbackEvent,
    CallbackRejected,
    Created,
    FetchedResult,
    JobRequest,
    JobView,
    Operation,
    UploadReceipt,
)

CAPABILITIES = Capabilities(
    idempotency_key=True, reconcile_by="client_ref", cancel=True, callbacks=False, reports_input_digest=True,
    result="download", billing_ledger=False, kinds=frozenset({"conversion"}), upload_modes=frozenset({"two_step", "inline"}),
)
# A converter that has not written its first status this long after its start never started.
START_GRACE_S = 30.0


def root() -> Path:
    path = Path(settings.DATA_DIR) / "engine"
    (path / "jobs").mkdir(parents=True, exist_ok=True)
    (path / "uploads").mkdir(parents=True, exist_ok=True)
    (path / "refs").mkdir(parents=True, exist_ok=True)
    return path


def budget_for(lane: str | None) -> dict[str, int]:
    """The converter budget of a lane (settings.ENGINE_BUDGETS), the default lane's otherwise."""
    budgets = settings.ENGINE_BUDGETS
    return {**budgets["default"], **budgets.get(lane or "", {})}


def _not_found(operation: str, job_id: str) -> VendorError:
    return VendorError(classify_status(404, "job_not_found"), operation=operation, status=404, code="job_not_found",
                       detail=f"no engine job {job_id}")


def _alive(pid: int | None, job_dir: Path) -> bool:
    """The process is running and is this job's (its command line names the job, or it works in
    the job's directory): never a reused pid."""
    if not pid:
        return False
    try:
        if str(job_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return True
        return os.readlink(f"/proc/{pid}/cwd").startswith(str(job_dir))
    except OSError:
        return False


class LocalEngineAdapter:
    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                 deadline: datetime | None = None) -> None:
        self.channel = channel
        self.capabilities = CAPABILITIES.narrowed(channel.capability_overrides)
        self.lane = None
        self.extension = ""
        if task_id is not None:
            from tasks.models import Task

            task = Task.objects.filter(pk=task_id).select_related("file").first()
            if task is not None:
                self.lane, self.extension = task.lane_id, task.file.extension

    def _extension(self, path: Path) -> str:
        """What the document is: the task's file type (stored files have no extension of their own)."""
        return (self.extension or path.suffix.lstrip(".") or "bin").lower()

    # --- the seam -------------------------------------------------------------------------------------
    def upload(self, path: Path, *, size: int, sha256: str, operation: Operation,
               on_chunk: Callable[[int], None] | None = None) -> UploadReceipt:
        self._require_engine("upload")
        target = root() / "uploads" / f"{sha256}.{self._extension(path)}"
        if not target.exists():
            temp = target.with_name(f".{target.name}.{os.getpid()}")
            shutil.copyfile(path, temp)
            os.replace(temp, target)
        if on_chunk:
            on_chunk(size)
        return UploadReceipt(upload_id=target.name)

    def create_job(self, request: JobRequest) -> Created:
        self._require_engine("create_job")
        key = request.operation.idempotency_key or request.operation.client_ref
        job_id = "cv-" + hashlib.sha256(f"{self.channel.name}:{key}".encode()).hexdigest()[:32]
        job_dir = root() / "jobs" / job_id
        if (job_dir / "request.json").exists():
            return Created(job=self._view(job_id), replayed=True)
        if request.upload_ref:
            source = root() / "uploads" / Path(request.upload_ref).name
        elif request.inline_path is not None:
            source = Path(request.inline_path)
        else:
            raise VendorError(classify_status(400), operation="create_job", status=400, code="no_input",
                              detail="a job needs an upload or an inline file")
        if not source.exists():
            raise VendorError(classify_status(404, "upload_not_found"), operation="create_job", status=404,
                              code="upload_not_found", detail="the upload is gone")
        extension = self._extension(source) if request.inline_path is not None else (source.suffix.lstrip(".") or "bin")
        if engine.plan(extension, request.target_format) is None:
            raise VendorError(classify_status(422), operation="create_job", status=422, code="unsupported_conversion",
                              detail=f"the engine cannot convert .{extension} to {request.target_format}")
        staging = job_dir.with_name(f".{job_id}.{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        if request.inline_path is not None:
            # The caller's file may be a temporary copy (files in a bucket): the job keeps its own.
            kept = staging / f"input.{extension}"
            shutil.copyfile(source, kept)
            source = job_dir / kept.name
        (staging / "request.json").write_text(json.dumps({
            "input": str(source), "extension": extension, "target": request.target_format,
            "client_ref": request.operation.client_ref, "idempotency_key": request.operation.idempotency_key,
            "input_sha256": request.sha256, "limits": budget_for(self.lane), "engine_version": engine.engine_version(),
            "created_at": time.time(), "test_markers": bool(settings.ENGINE_TEST_MARKERS),
            "warm": _warm_settings(self.lane),
        }))
        (staging / "status.json").write_text(json.dumps({"status": "queued"}))
        try:
            os.rename(staging, job_dir)  # one create wins; a concurrent one replays it
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            return Created(job=self._view(job_id), replayed=True)
        with open(root() / "refs" / _ref_file(request.operation.client_ref), "a") as refs:
            refs.write(job_id + "\n")
        self._start(job_dir)
        return Created(job=self._view(job_id))

    def get_job(self, job_id: str) -> JobView:
        return self._view(job_id)

    def find_jobs(self, operation: Operation) -> list[JobView]:
        refs = root() / "refs" / _ref_file(operation.client_ref)
        ids = refs.read_text().split() if refs.exists() else []
        return [self._view(job_id) for job_id in dict.fromkeys(ids) if (root() / "jobs" / job_id).exists()]

    def cancel_job(self, job_id: str) -> JobView:
        job_dir = self._dir(job_id, "cancel_job")
        status = _status(job_dir)
        if status.get("status") in ("queued", "processing"):
            # The runner first (so it cannot report the kill as a failure), then the converter's
            # whole group (it leads its own session); each only if it is this job's, not a reused pid.
            for pid, kill in ((status.get("pid"), os.kill), (status.get("child_pid"), os.killpg)):
                if _alive(pid, job_dir):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            from tasks.engine.runner import write_status

            write_status(job_dir, status="canceled", finished_at=time.time())
            engine.remove_pipes(job_dir / "tmp" / "profile")  # a killed LibreOffice leaves its pipe in /tmp
            shutil.rmtree(job_dir / "tmp", ignore_errors=True)
        return self._view(job_id)

    def release(self, job_id: str) -> None:
        return None  # the engine's job directories follow its own retention

    def fetch_result(self, job_id: str, dest: Path, *, target_format: str) -> FetchedResult:
        job_dir = self._dir(job_id, "fetch_result")
        status = _status(job_dir)
        if status.get("status") != "completed":
            raise VendorError(classify_status(409), operation="fetch_result", status=409, code="not_completed",
                              detail=f"the job is {status.get('status')}")
        digest = hashlib.sha256()
        dest.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        with open(job_dir / status["result"], "rb") as source, open(dest, "wb") as out:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
                size += len(block)
        return FetchedResult(sha256=digest.hexdigest(), size=size, content_type=status["content_type"],
                             declared_sha256=status.get("sha256"))

    def list_billing(self, *, cursor: str | None, limit: int) -> BillingPage:
        return BillingPage(entries=[], next_cursor=None)  # the engine bills nothing

    def probe(self) -> None:
        self._require_engine("probe")

    def verify_callback(self, headers: Mapping[str, str], body: bytes) -> CallbackEvent:
        raise CallbackRejected(404, "not_found", "The local engine sends no callbacks.")

    # --- helpers --------------------------------------------------------------------------------------
    def _require_engine(self, operation: str) -> None:
        if not engine.installed():
            raise VendorError(classify_status(503), operation=operation, status=503, code="engine_not_installed",
                              detail="LibreOffice or poppler is not installed on this host")

    def _dir(self, job_id: str, operation: str) -> Path:
        job_dir = root() / "jobs" / Path(job_id).name
        if not (job_dir / "request.json").exists():
            raise _not_found(operation, job_id)
        return job_dir

    def _start(self, job_dir: Path) -> None:
        subprocess.run([sys.executable, "-m", "tasks.engine.runner", str(job_dir)], cwd=settings.BASE_DIR,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
                       check=False)

    def _view(self, job_id: str) -> JobView:
        job_dir = self._dir(job_id, "get_job")
        request = json.loads((job_dir / "request.json").read_text())
        status = _status(job_dir)
        state = status.get("status", "queued")
        if state in ("queued", "processing") and not _alive(status.get("pid"), job_dir):
            started = status.get("started_at") or request.get("created_at", 0)
            if state == "processing" or time.time() - started > START_GRACE_S:
                # The converter died without a word (killed from outside, the host restarted).
                from tasks.engine.runner import write_status

                write_status(job_dir, status="failed", error_code="engine_crashed",
                             error_message="the converter process ended without a result", finished_at=time.time())
                status = _status(job_dir)
                state = "failed"
        return JobView(
            id=job_id, status=state, client_ref=request.get("client_ref", ""), input_sha256=request.get("input_sha256", ""),
            result_sha256=status.get("sha256"), result_size=status.get("size"), result_content_type=status.get("content_type"),
            error_code=status.get("error_code"), error_message=(f"{status.get('error_message')} ({request.get('engine_version')})"
                                                               if status.get("error_message") else None),
            error_retryable=False, billing_units=0, billing_unit="document", amount_cents=0,
            engine_version=request.get("engine_version", ""),
        )


def _warm_settings(lane: str | None) -> dict[str, Any] | None:
    """How this lane's conversions use warm converters (None: each starts its own LibreOffice)."""
    pool = settings.ENGINE_WARM_POOL.get(lane or "interactive", 0)
    if pool <= 0:
        return None
    return {"lane": lane or "interactive", "pool": pool, "recycle_after": settings.ENGINE_WARM_RECYCLE_AFTER,
            "idle_s": settings.ENGINE_WARM_IDLE_S}


def _status(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((job_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {"status": "queued"}


def _ref_file(client_ref: str) -> str:
    return hashlib.sha256(client_ref.encode()).hexdigest()[:40]
