"""An in-memory vendor behind the adapter seam (no HTTP), for tests of the steps' decisions.

    vendor = MemoryVendor.for_channel("primary", capabilities=...)
    vendor.script("create_job", lost_answer())      # the job is created, the answer never comes
    vendor.script("get_job", not_processed(503))    # one poll refused
    ... run the steps (channel.dialect = "memory") ...
    assert vendor.billed() == 1

Jobs complete after `polls_to_complete` reads of their status. Whatever a script says happens
exactly as a real vendor would do it: a lost answer still creates (and bills) the job.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from tasks.models import VendorChannel
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.classification import classify_exception, classify_status
from tasks.vendors.errors import VendorError
from tasks.vendors.protocol import (
    BillingEntry,
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
    result="download", billing_ledger=True, kinds=frozenset({"transcription", "conversion"}),
    upload_modes=frozenset({"two_step", "inline"}),
)
_ids = itertools.count(1)


@dataclass
class Scripted:
    """What one scripted call does: raise `error`, after doing the work when `after_effect`."""

    error: VendorError
    after_effect: bool = False


def not_processed(status: int = 503) -> Scripted:
    return Scripted(VendorError(classify_status(status), operation="scripted", status=status))


def lost_answer() -> Scripted:
    """The vendor acts (a create bills a job), then the connection breaks before the answer."""
    return Scripted(VendorError(classify_exception("ReadError"), operation="scripted", error_class="ReadError"),
                    after_effect=True)


def refused(status: int = 400) -> Scripted:
    return Scripted(VendorError(classify_status(status), operation="scripted", status=status))


@dataclass
class MemoryVendor:
    name: str
    capabilities: Capabilities = CAPABILITIES
    polls_to_complete: int = 1
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    uploads: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    ledger: list[BillingEntry] = field(default_factory=list)
    scripts: dict[str, list[Scripted]] = field(default_factory=lambda: defaultdict(list))
    calls: list[str] = field(default_factory=list)

    vendors: ClassVar[dict[str, MemoryVendor]] = {}

    @classmethod
    def for_channel(cls, name: str, **settings: Any) -> MemoryVendor:
        cls.vendors[name] = cls(name=name, **settings)
        return cls.vendors[name]

    def script(self, operation: str, *outcomes: Scripted) -> None:
        self.scripts[operation].extend(outcomes)

    def billed(self) -> int:
        return len(self.ledger)

    def _scripted(self, operation: str) -> Scripted | None:
        self.calls.append(operation)
        queue = self.scripts.get(operation)
        return queue.pop(0) if queue else None

    def _run(self, operation: str, work: Callable[[], Any]) -> Any:
        scripted = self._scripted(operation)
        if scripted is None:
            return work()
        if scripted.after_effect:
            work()
        raise scripted.error

    def _view(self, job: dict[str, Any]) -> JobView:
        return replace(job["view"])


class MemoryAdapter:
    """A VendorAdapter over a MemoryVendor (found by the channel's name)."""

    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                 deadline: datetime | None = None) -> None:
        self.vendor = MemoryVendor.vendors.get(channel.name) or MemoryVendor.for_channel(channel.name)
        self.capabilities = self.vendor.capabilities.narrowed(channel.capability_overrides)

    def upload(self, path: Path, *, size: int, sha256: str, operation: Operation,
               on_chunk: Callable[[int], None] | None = None) -> UploadReceipt:
        def work() -> UploadReceipt:
            upload_id = f"up-{next(_ids)}"
            self.vendor.uploads[upload_id] = sha256
            return UploadReceipt(upload_id=upload_id)

        return self.vendor._run("upload", work)

    def create_job(self, request: JobRequest) -> Created:
        def work() -> Created:
            key = request.operation.idempotency_key
            if self.capabilities.idempotency_key and key in self.vendor.keys:
                return Created(job=self.vendor._view(self.vendor.jobs[self.vendor.keys[key]]), replayed=True)
            sha = request.sha256 or self.vendor.uploads.get(request.upload_ref or "", "")
            job_id = f"job-{next(_ids)}"
            view = JobView(id=job_id, status="queued", client_ref=request.operation.client_ref, input_sha256=sha,
                           amount_cents=2, billing_units=1, billing_unit="audio_minute",
                           natural_key=request.upload_ref or "")
            self.vendor.jobs[job_id] = {"view": view, "polls": 0, "result": f"result of {sha}".encode()}
            if key:
                self.vendor.keys[key] = job_id
            self.vendor.ledger.append(BillingEntry(
                entry_id=f"le-{job_id}", job_id=job_id, client_ref=view.client_ref, idempotency_key=key, units=1,
                unit="audio_minute", amount_cents=2, created_at="2026-01-01T00:00:00Z",
            ))
            return Created(job=view)

        return self.vendor._run("create_job", work)

    def get_job(self, job_id: str) -> JobView:
        def work() -> JobView:
            job = self.vendor.jobs.get(job_id)
            if job is None:
                raise VendorError(classify_status(404, "job_not_found"), operation="get_job", status=404,
                                  code="job_not_found")
            job["polls"] += 1
            if not job["view"].terminal and job["polls"] >= self.vendor.polls_to_complete:
                data = job["result"]
                job["view"] = replace(job["view"], status="completed", result_sha256=hashlib.sha256(data).hexdigest(),
                                      result_size=len(data), result_content_type="text/plain")
            return self.vendor._view(job)

        return self.vendor._run("get_job", work)

    def find_jobs(self, operation: Operation) -> list[JobView]:
        def work() -> list[JobView]:
            return [self.vendor._view(j) for j in self.vendor.jobs.values()
                    if j["view"].client_ref == operation.client_ref]

        return self.vendor._run("find_jobs", work)

    def cancel_job(self, job_id: str) -> JobView:
        def work() -> JobView:
            job = self.vendor.jobs[job_id]
            if not job["view"].terminal:
                job["view"] = replace(job["view"], status="canceled")
            return self.vendor._view(job)

        return self.vendor._run("cancel_job", work)

    def release(self, job_id: str) -> None:
        return None  # nothing is kept outside this process

    def fetch_result(self, job_id: str, dest: Path, *, target_format: str) -> FetchedResult:
        def work() -> FetchedResult:
            data = self.vendor.jobs[job_id]["result"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            return FetchedResult(sha256=hashlib.sha256(data).hexdigest(), size=len(data), content_type="text/plain")

        return self.vendor._run("fetch_result", work)

    def list_billing(self, *, cursor: str | None, limit: int) -> BillingPage:
        start = int(cursor or 0)
        entries = self.vendor.ledger[start:start + limit]
        more = start + limit < len(self.vendor.ledger)
        return BillingPage(entries=entries, next_cursor=str(start + limit) if more else None)

    def probe(self) -> None:
        self.vendor._run("probe", lambda: None)

    def verify_callback(self, headers: Mapping[str, str], body: bytes) -> CallbackEvent:
        raise CallbackRejected(404, "not_found", "This vendor sends no callbacks.")
