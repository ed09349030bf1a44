"""The httpx implementation of the vendor contract (shared/contracts/vendor-api.md).

Every call: asks the channel's breaker for a permit, applies the channel's time layers, streams
bodies from and to disk, classifies any failure with the one table, writes a VendorCall row and
one whitelisted log line, and feeds the breaker. No call may be made inside a transaction.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from django.db import connection

from tasks import timescale
from tasks.models import ChannelHealth, VendorCall, VendorChannel
from tasks.observability import log_event
from tasks.vendors import breaker
from tasks.vendors.classification import Outcome, Row, classify_exception, classify_status
from tasks.vendors.errors import (
    BreakerOpen,
    MalformedResponse,
    StopUpload,
    UploadDeadlineExceeded,
    VendorError,
)
from tasks.vendors.policies import BreakerPolicy, TimeoutPolicy, parse_retry_after

CHUNK = 64 * 1024
# A small send buffer keeps what the kernel sends on our behalf after we give up on an upload
# small, so the wall-clock deadline governs the upload rather than megabytes queued in the kernel.
SEND_BUFFER = 128 * 1024
MUTATIONS = frozenset({"create_job", "cancel_job"})
JOB_STATUSES = frozenset({"queued", "processing", "completed", "failed", "canceled"})
_OK = Row(Outcome.OK, False, "ok")
_clients: dict[tuple[int, str], httpx.Client] = {}


@dataclass(frozen=True)
class JobView:
    id: str
    status: str
    client_ref: str
    input_sha256: str
    result_sha256: str | None
    result_size: int | None
    result_content_type: str | None
    error_code: str | None
    error_message: str | None
    error_retryable: bool
    billing_units: float | None
    billing_unit: str | None
    amount_cents: int | None
    created_at: str

    @property
    def terminal(self) -> bool:
        return self.status in ("completed", "failed", "canceled")

    @classmethod
    def from_json(cls, data: Any) -> JobView:
        """A job object as the contract defines it; MalformedResponse when it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not data["id"]:
            raise MalformedResponse("a job without an id")
        if data.get("status") not in JOB_STATUSES:
            raise MalformedResponse(f"a job with status {str(data.get('status'))[:20]!r}")
        result = data.get("result") or {}
        error = data.get("error") or {}
        billing = data.get("billing") or {}
        if not all(isinstance(part, dict) for part in (result, error, billing, data.get("input") or {})):
            raise MalformedResponse("a job whose result, error, input or billing is not an object")
        return cls(
            id=data["id"],
            status=data["status"],
            client_ref=str(data.get("client_ref") or ""),
            input_sha256=str((data.get("input") or {}).get("sha256") or ""),
            result_sha256=result.get("sha256"),
            result_size=result.get("size"),
            result_content_type=result.get("content_type"),
            error_code=error.get("code"),
            error_message=error.get("message"),
            error_retryable=bool(error.get("retryable", False)),
            billing_units=billing.get("units"),
            billing_unit=billing.get("unit"),
            amount_cents=billing.get("amount_cents"),
            created_at=str(data.get("created_at") or ""),
        )


@dataclass(frozen=True)
class Created:
    job: JobView
    replayed: bool


@dataclass(frozen=True)
class UploadReceipt:
    upload_id: str
    expires_at: str | None


@dataclass(frozen=True)
class FetchedResult:
    sha256: str
    size: int
    content_type: str
    declared_sha256: str | None


def _http_client(base_url: str) -> httpx.Client:
    # One pooled client per process and vendor; django-q2 forks workers, so key by pid.
    key = (os.getpid(), base_url)
    client = _clients.get(key)
    if client is None:
        transport = httpx.HTTPTransport(
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
            socket_options=[(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)],
        )
        client = httpx.Client(transport=transport, follow_redirects=False, trust_env=False)
        _clients[key] = client
    return client


class VendorClient:
    """One vendor channel, on behalf of one task attempt (for the call records)."""

    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None) -> None:
        self.channel = channel
        self.task_id = task_id
        self.generation = generation
        self.timeouts = TimeoutPolicy.for_channel(channel)
        self.base = channel.base_url.rstrip("/")
        self.http = _http_client(self.base)

    # --- operations --------------------------------------------------------------------
    def upload(self, path: Path, *, size: int, sha256: str, on_chunk: Callable[[int], None] | None = None,
               client_ref: str = "") -> UploadReceipt:
        # X-Client-Ref is not part of the contract; it only lets a vendor's logs tie the upload to the job.
        headers = {"X-Client-Ref": client_ref} if client_ref else None
        return self._send_file("upload", "POST", "/v1/uploads", path, size=size, sha256=sha256, on_chunk=on_chunk,
                               headers=headers, parse=_upload_receipt)

    def create_job(
        self,
        *,
        kind: str,
        target_format: str,
        client_ref: str,
        idempotency_key: str,
        options: dict[str, Any] | None = None,
        upload_id: str | None = None,
        inline_path: Path | None = None,
        size: int = 0,
        sha256: str = "",
        callback_url: str | None = None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> Created:
        headers = {"Idempotency-Key": idempotency_key}
        if inline_path is not None:
            params = {"kind": kind, "target_format": target_format, "client_ref": client_ref}
            if options:
                import json

                params["options"] = json.dumps(options, sort_keys=True)
            if callback_url:
                params["callback_url"] = callback_url
            return self._send_file(
                "create_job", "POST", "/v1/jobs", inline_path, size=size, sha256=sha256,
                on_chunk=on_chunk, params=params, headers=headers, parse=_created,
            )
        else:
            body = {
                "upload_id": upload_id,
                "kind": kind,
                "target_format": target_format,
                "client_ref": client_ref,
                "options": options or {},
            }
            if callback_url:
                body["callback_url"] = callback_url
        return self._call(
            "create_job", "POST", "/v1/jobs", json=body, headers=headers,
            timeout=self._timeout(self.timeouts.acceptance_wait_s()), parse=_created,
        )

    def get_job(self, job_id: str) -> JobView:
        return self._call("get_job", "GET", f"/v1/jobs/{job_id}", parse=_job)

    def list_jobs(self, client_ref: str) -> list[JobView]:
        jobs: list[JobView] = []
        cursor = None
        for _ in range(50):
            params = {"client_ref": client_ref, "limit": 100}
            if cursor:
                params["cursor"] = cursor
            page = self._call("list_jobs", "GET", "/v1/jobs", params=params, parse=_job_page)
            jobs.extend(page.jobs)
            cursor = page.next_cursor
            if not cursor:
                break
        return jobs

    def cancel_job(self, job_id: str) -> JobView:
        return self._call("cancel_job", "POST", f"/v1/jobs/{job_id}/cancel", parse=_job)

    def usage(self, *, since: str | None = None, cursor: str | None = None, limit: int = 500) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if since:
            params["since"] = since
        if cursor:
            params["cursor"] = cursor
        return self._call("usage", "GET", "/v1/usage", params=params, parse=_usage_page)

    def probe(self) -> None:
        """A cheap read used as a half-open trial call."""
        self._call("probe", "GET", "/v1/jobs", params={"client_ref": "sluice-probe", "limit": 1})

    def fetch_result(self, job_id: str, dest: Path) -> FetchedResult:
        """Stream a result to `dest`, hashing as it arrives; memory does not grow with size."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0

        def consume(response: httpx.Response) -> FetchedResult:
            nonlocal size
            with open(dest, "wb") as out:
                for chunk in response.iter_bytes(CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            return FetchedResult(
                sha256=digest.hexdigest(),
                size=size,
                content_type=response.headers.get("Content-Type", "application/octet-stream"),
                declared_sha256=response.headers.get("X-Content-SHA256"),
            )

        return self._call(
            "get_result", "GET", f"/v1/jobs/{job_id}/result",
            timeout=self._timeout(self.timeouts.result_s), consume=consume,
        )

    # --- plumbing -----------------------------------------------------------------------
    def _timeout(self, read_s: float, write_s: float | None = None) -> httpx.Timeout:
        return httpx.Timeout(
            connect=timescale.seconds(self.timeouts.connect_s),
            read=timescale.seconds(read_s),
            write=timescale.seconds(write_s if write_s is not None else read_s),
            pool=timescale.seconds(self.timeouts.connect_s),
        )

    def _send_file(
        self,
        operation: str,
        method: str,
        path: str,
        file_path: Path,
        *,
        size: int,
        sha256: str,
        on_chunk: Callable[[int], None] | None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        parse: Callable[[httpx.Response], Any] | None = None,
    ) -> Any:
        budget_s = timescale.seconds(self.timeouts.upload_budget_s(size))
        deadline = time.monotonic() + budget_s
        sent = [0]

        def chunks() -> Iterator[bytes]:
            # Reopened from byte 0 for every request: a retry never reuses a consumed stream.
            with open(file_path, "rb") as handle:
                while True:
                    chunk = handle.read(CHUNK)
                    if not chunk:
                        return
                    if time.monotonic() > deadline:
                        raise UploadDeadlineExceeded()
                    if on_chunk is not None:
                        on_chunk(len(chunk))
                    sent[0] += len(chunk)
                    yield chunk

        all_headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(size),
            "X-Content-SHA256": sha256,
            **(headers or {}),
        }
        # The per-write timeout never fires on a slow trickle; the deadline above does.
        timeout = self._timeout(self.timeouts.acceptance_wait_s(), write_s=self.timeouts.upload_budget_s(size))
        return self._call(
            operation, method, path, content=chunks(), headers=all_headers, params=params,
            timeout=timeout, parse=parse, sent_counter=sent,
        )

    def _call(
        self,
        operation: str,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        parse: Callable[[httpx.Response], Any] | None = None,
        consume: Callable[[httpx.Response], Any] | None = None,
        sent_counter: list[int] | None = None,
    ) -> Any:
        """One call. A success is parsed (`parse`, default JSON) or streamed (`consume`) here, so a
        body that is not what the contract promises fails as MalformedResponse, classified."""
        if connection.in_atomic_block:
            raise RuntimeError("no vendor call may be made inside a database transaction")
        try:
            permit = breaker.acquire(self.channel)
        except BreakerOpen as exc:
            row = classify_exception("BreakerOpen")
            self._record(operation, row, error_class="BreakerOpen", duration=0.0, counted=False)
            raise VendorError(row, operation=operation, error_class="BreakerOpen", retry_after_s=None) from exc
        request_headers = {"Authorization": f"Bearer {self.channel.api_key}", **(headers or {})}
        started = time.monotonic()
        status: int | None = None
        received = 0
        try:
            request = self.http.build_request(
                method, self.base + path, json=json, content=content, params=params,
                headers=request_headers, timeout=timeout or self._timeout(self.timeouts.status_s),
            )
            response = self.http.send(request, stream=True)
            try:
                status = response.status_code
                if 200 <= status < 300 and consume is not None:
                    result = consume(response)
                    received = int(response.num_bytes_downloaded)
                else:
                    response.read()
                    received = len(response.content)
                    result = None
                if 200 <= status < 300 and consume is None:
                    result = parse(response) if parse is not None else _json_object(response)
            finally:
                response.close()
        except StopUpload:
            raise
        except MalformedResponse as exc:
            row = classify_exception("MalformedResponse")
            self._record(operation, row, status=status, error_class="MalformedResponse",
                         duration=time.monotonic() - started, sent=(sent_counter or [0])[0], received=received,
                         permit=permit)
            raise VendorError(row, operation=operation, status=status, code="malformed_response",
                              error_class="MalformedResponse", detail=str(exc)[:200],
                              bytes_sent=(sent_counter or [0])[0]) from None
        except Exception as exc:
            row = classify_exception(exc)
            duration = time.monotonic() - started
            error = VendorError(
                row, operation=operation, error_class=type(exc).__name__,
                bytes_sent=(sent_counter or [0])[0],
            )
            self._record(operation, row, error_class=type(exc).__name__, duration=duration,
                         sent=error.bytes_sent, permit=permit)
            raise error from None
        duration = time.monotonic() - started
        sent = (sent_counter or [0])[0]
        if 300 <= status < 400:
            row = classify_status(status)
            location = response.headers.get("Location", "")[:200]
            self._record(operation, row, status=status, duration=duration, sent=sent, received=received,
                         permit=permit, code="redirected")
            raise VendorError(row, operation=operation, status=status, code="redirected", bytes_sent=sent,
                              detail=f"HTTP {status} to {location or '(no Location)'}")
        if status >= 400 or status < 200:
            code = _problem_code(response)
            row = classify_status(status, code)
            retry_after = parse_retry_after(response.headers.get("Retry-After"), date_header=response.headers.get("Date"))
            if status == 429:
                ChannelHealth.objects.filter(pk=self.channel.pk).update(
                    last_rate_limited_at=_now(), last_retry_after_s=retry_after
                )
            self._record(operation, row, status=status, duration=duration, sent=sent, received=received,
                         retry_after=retry_after, permit=permit, code=code)
            raise VendorError(row, operation=operation, status=status, code=code, retry_after_s=retry_after, bytes_sent=sent)
        self._record(operation, _OK, status=status, duration=duration, sent=sent, received=received, permit=permit)
        return result

    def _record(
        self,
        operation: str,
        row: Row,
        *,
        duration: float,
        status: int | None = None,
        error_class: str = "",
        sent: int = 0,
        received: int = 0,
        retry_after: float | None = None,
        permit: breaker.Permit | None = None,
        counted: bool = True,
        code: str | None = None,
    ) -> None:
        policy = BreakerPolicy.for_channel(self.channel)
        slow = duration > timescale.seconds(policy.slow_call_s) and operation not in ("upload", "get_result")
        failure = row.breaker_failure
        counts = counted and row.outcome != Outcome.REFUSED and row.outcome != Outcome.ALARM
        decision = _decision(operation, row.outcome)
        VendorCall.objects.create(
            channel=self.channel,
            task_id=self.task_id,
            generation=self.generation,
            operation=operation,
            status_code=status,
            error_class=error_class or (code or ""),
            outcome=row.outcome,
            decision=decision,
            duration_ms=int(duration * 1000),
            bytes_sent=sent,
            bytes_received=received,
            retry_after_s=retry_after,
            counts_for_breaker=counts,
            breaker_failure=failure and counts,
            slow=slow and counts,
        )
        log_event(
            "vendor_call",
            task_id=self.task_id,
            generation=self.generation,
            channel=self.channel.name,
            operation=operation,
            status=status if status is not None else error_class,
            duration_ms=int(duration * 1000),
            bytes=sent + received,
            decision=decision,
            retry_after_s=retry_after,
        )
        if counted:
            breaker.record(self.channel, permit, failure=(failure and counts) or (slow and counts))


@dataclass(frozen=True)
class JobPage:
    jobs: list[JobView]
    next_cursor: str | None


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        raise MalformedResponse(f"a {response.status_code} whose body is not JSON") from None
    if not isinstance(data, dict):
        raise MalformedResponse(f"a {response.status_code} whose body is not a JSON object")
    return data


def _cursor(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, int)):
        raise MalformedResponse("a page whose next_cursor is not a string")
    return str(value)


def _job(response: httpx.Response) -> JobView:
    return JobView.from_json(_json_object(response))


def _created(response: httpx.Response) -> Created:
    return Created(job=_job(response), replayed=response.headers.get("Idempotent-Replayed", "").lower() == "true")


def _upload_receipt(response: httpx.Response) -> UploadReceipt:
    data = _json_object(response)
    if not isinstance(data.get("upload_id"), str) or not data["upload_id"]:
        raise MalformedResponse("an upload answer without an upload_id")
    expires = data.get("expires_at")
    return UploadReceipt(upload_id=data["upload_id"], expires_at=expires if isinstance(expires, str) else None)


def _job_page(response: httpx.Response) -> JobPage:
    data = _json_object(response)
    if not isinstance(data.get("data"), list):
        raise MalformedResponse("a job list without a data list")
    return JobPage(jobs=[JobView.from_json(item) for item in data["data"]], next_cursor=_cursor(data.get("next_cursor")))


def _usage_page(response: httpx.Response) -> dict[str, Any]:
    data = _json_object(response)
    entries = data.get("data")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("entry_id") for e in entries):
        raise MalformedResponse("a usage page without a data list of entries")
    return {"data": entries, "next_cursor": _cursor(data.get("next_cursor"))}


def _decision(operation: str, outcome: Outcome) -> str:
    if outcome == Outcome.OK:
        return "accept"
    if outcome == Outcome.NOT_PROCESSED:
        return "retry"
    if outcome == Outcome.AMBIGUOUS:
        return "reconcile" if operation in MUTATIONS else "retry"
    if outcome == Outcome.ALARM:
        return "fail_alarm"
    return "fail"


def _problem_code(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        return body["code"][:64]
    return None


def _now():
    from django.utils import timezone

    return timezone.now()
