"""The adapter seam: what the execution steps ask of a vendor, and the values that cross it.

Every vendor dialect implements `VendorAdapter`; the steps call nothing else and never see HTTP.
A call either returns one of the values below or raises a `VendorError` that is already classified
(tasks/vendors/classification.py: not processed, ambiguous, refused, alarm). What an adapter can
and cannot do is declared by its `capabilities`, and the steps decide from those: an ambiguous
create is reconciled only where the vendor can be asked, never resent blindly.

Statuses are normalised to queued | processing | completed | failed | canceled (a vendor's own
words, such as AssemblyAI's "error", are mapped by its adapter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tasks.vendors.capabilities import Capabilities

JOB_STATUSES = frozenset({"queued", "processing", "completed", "failed", "canceled"})
TERMINAL_STATUSES = frozenset({"completed", "failed", "canceled"})


@dataclass(frozen=True)
class Operation:
    """What identifies one vendor operation of a task at the vendor, whichever way it can be found
    again: our client_ref (and idempotency key), or the natural key the vendor echoes back (the
    URL its upload returned)."""

    client_ref: str
    idempotency_key: str
    upload_ref: str = ""


@dataclass(frozen=True)
class JobView:
    id: str
    status: str
    client_ref: str = ""
    input_sha256: str = ""
    result_sha256: str | None = None
    result_size: int | None = None
    result_content_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    error_retryable: bool = False
    billing_units: float | None = None
    billing_unit: str | None = None
    amount_cents: int | None = None
    created_at: str = ""
    # The natural key a vendor echoes (AssemblyAI's audio_url); "" where there is none.
    natural_key: str = ""
    # What processed it, where the vendor says (the local engine's LibreOffice and poppler).
    engine_version: str = ""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class Created:
    job: JobView
    replayed: bool = False


@dataclass(frozen=True)
class UploadReceipt:
    upload_id: str
    expires_at: str | None = None


@dataclass(frozen=True)
class FetchedResult:
    sha256: str
    size: int
    content_type: str
    declared_sha256: str | None = None


@dataclass(frozen=True)
class JobRequest:
    """Create a job: from an earlier upload (`upload_ref`) or with the file as the body (`inline_path`)."""

    kind: str
    target_format: str
    operation: Operation
    options: dict[str, Any] = field(default_factory=dict)
    upload_ref: str | None = None
    inline_path: Path | None = None
    size: int = 0
    sha256: str = ""
    callback_url: str | None = None
    on_chunk: Callable[[int], None] | None = None


@dataclass(frozen=True)
class BillingEntry:
    entry_id: str
    job_id: str
    client_ref: str
    idempotency_key: str
    units: float
    unit: str
    amount_cents: int
    created_at: str


@dataclass(frozen=True)
class BillingPage:
    entries: list[BillingEntry]
    next_cursor: str | None


@dataclass(frozen=True)
class CallbackEvent:
    """A vendor's job event, authenticated: which job, and an id to de-duplicate it by."""

    event_id: str
    job_id: str


class CallbackRejected(Exception):
    """A callback that is not authentic or not understood; `status` is what to answer."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


class VendorAdapter(Protocol):
    """One vendor channel, on behalf of one task attempt (for the call records)."""

    capabilities: Capabilities

    def upload(self, path: Path, *, size: int, sha256: str, operation: Operation,
               on_chunk: Callable[[int], None] | None = None) -> UploadReceipt:
        """Send the file (two-step mode); uploads are never billed."""

    def create_job(self, request: JobRequest) -> Created:
        """Create (and so have billed) one job for the operation."""

    def get_job(self, job_id: str) -> JobView:
        """The job as the vendor reports it now."""

    def find_jobs(self, operation: Operation) -> list[JobView]:
        """Every job the vendor holds for this operation, duplicates included (reconciliation).
        Only called where `capabilities.reconcile_by` is not "none"."""

    def cancel_job(self, job_id: str) -> JobView:
        """Ask the vendor to stop (or, for a finished job of a vendor that cannot stop one, to
        drop) the job; returns what it reports."""

    def fetch_result(self, job_id: str, dest: Path, *, target_format: str) -> FetchedResult:
        """Write the completed job's result to `dest`, streamed and hashed as it arrives."""

    def release(self, job_id: str) -> None:
        """The job's result is kept by Sluice now: delete the vendor's copies of its data (uploaded
        media, result files) where they are ours to delete. Best effort; a job record the vendor
        uses to refuse a second create of the operation stays."""

    def list_billing(self, *, cursor: str | None, limit: int) -> BillingPage:
        """One page of the vendor's usage ledger (only where `capabilities.billing_ledger`)."""

    def probe(self) -> None:
        """A cheap read, used as a circuit breaker's trial call."""

    def verify_callback(self, headers: Mapping[str, str], body: bytes) -> CallbackEvent:
        """Authenticate and parse a vendor callback, or raise CallbackRejected."""
