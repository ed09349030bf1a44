"""The HTTP plumbing every HTTP dialect shares (httpx), and nothing dialect-specific.

Every call: asks the channel's breaker for a permit, applies the channel's time layers, streams
bodies from and to disk, classifies any failure with the one table, writes a VendorCall row and
one whitelisted log line, and feeds the breaker. Redirects are never followed. No call may be
made inside a transaction. A dialect gives its authentication headers and says how to read an
error body; it parses successes itself (a body it cannot read is MalformedResponse).
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from django.db import connection
from django.utils import timezone

from tasks import timescale
from tasks.models import ChannelHealth, VendorCall, VendorChannel
from tasks.observability import log_event
from tasks.rows import insert_rows, new_row
from tasks.vendors import breaker
from tasks.vendors.classification import Outcome, Row, classify_exception, classify_status
from tasks.vendors.errors import (
    BreakerOpen,
    DownloadDeadlineExceeded,
    MalformedResponse,
    StopUpload,
    UploadDeadlineExceeded,
    VendorError,
)
from tasks.vendors.policies import BreakerPolicy, TimeoutPolicy, parse_retry_after
from tasks.vendors.protocol import FetchedResult

CHUNK = 64 * 1024
# A small send buffer keeps what the kernel sends on our behalf after we give up on an upload
# small, so the wall-clock deadline governs the upload rather than megabytes queued in the kernel.
SEND_BUFFER = 128 * 1024
MUTATIONS = frozenset({"create_job", "cancel_job"})
_OK = Row(Outcome.OK, False, "ok")
# Real seconds a call is given even when its attempt is (nearly) out of time.
MIN_CALL_S = 0.5
_clients: dict[tuple[int, str, bool], httpx.Client] = {}

ErrorDetails = Callable[[httpx.Response], "tuple[str | None, str]"]


_contexts: dict[tuple[bool, str, str], ssl.SSLContext] = {}


def ssl_context(*, http2: bool = False) -> ssl.SSLContext:
    """The TLS settings a vendor client verifies with (httpx's: certifi's roots, or SSL_CERT_FILE
    / SSL_CERT_DIR when set), built once per process (tens of milliseconds each time) and inherited by the
    workers a cluster forks. One per protocol: the connection pool sets its ALPN protocols on it."""
    key = (http2, os.environ.get("SSL_CERT_FILE", ""), os.environ.get("SSL_CERT_DIR", ""))
    if key not in _contexts:
        _contexts[key] = httpx.create_ssl_context()
    return _contexts[key]


def _http_client(base_url: str, *, http2: bool = False) -> httpx.Client:
    # One pooled client per process, vendor and protocol; django-q2 forks workers, so key by pid.
    key = (os.getpid(), base_url, http2)
    client = _clients.get(key)
    if client is None:
        # HTTP/2: over TLS it is negotiated (ALPN, HTTP/1.1 as the fallback); in clear text it is
        # spoken from the first byte (prior knowledge), as h2c vendors and proxies expect. Streams a
        # GOAWAY refuses (above its last-stream-id: provably not processed) are resent by the pool
        # on a new connection; a stream it cut off after it may have been processed surfaces as a
        # RemoteProtocolError, which the classification table treats as ambiguous.
        tls = base_url.startswith("https://")
        transport = httpx.HTTPTransport(
            verify=ssl_context(http2=http2),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
            socket_options=[(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)],
            http1=tls or not http2, http2=http2,
        )
        client = _VendorClient(transport=transport, follow_redirects=False, trust_env=False)
        _clients[key] = client
    return client


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass

    def set(self, name: str, value: str, domain: str = "", path: str = "/") -> None:
        pass


class _VendorClient(httpx.Client):
    """A vendor's pooled client, which neither keeps nor sends cookies. Vendor APIs authenticate
    by header; a cookie a vendor set in its answer to one task's call would otherwise be sent
    with every later call of this process to that vendor, whoever's task it is. (Parsing each
    answer for cookies was also a sixth of a step's CPU.)"""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NoCookies()

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        pass



class VendorHttp:
    """Calls to one channel on behalf of one task attempt (for the call records)."""

    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                 auth_headers: Mapping[str, str], error_details: ErrorDetails, deadline: datetime | None = None) -> None:
        self.channel = channel
        self.task_id = task_id
        self.generation = generation
        # No call outlives the attempt it serves: every timeout is capped by what remains of it.
        self.deadline = deadline
        self.timeouts = TimeoutPolicy.for_channel(channel)
        self.base = channel.base_url.rstrip("/")
        self.http = _http_client(self.base, http2=channel.http2)
        self.auth_headers = dict(auth_headers)
        self.error_details = error_details

    def remaining_s(self) -> float | None:
        """Real seconds left of the attempt (never below a floor that lets one call be tried)."""
        if self.deadline is None:
            return None
        return max((self.deadline - timezone.now()).total_seconds(), MIN_CALL_S)

    def capped(self, real_s: float) -> float:
        remaining = self.remaining_s()
        return real_s if remaining is None else min(real_s, remaining)

    def timeout(self, read_s: float, write_s: float | None = None) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.capped(timescale.seconds(self.timeouts.connect_s)),
            read=self.capped(timescale.seconds(read_s)),
            write=self.capped(timescale.seconds(write_s if write_s is not None else read_s)),
            pool=self.capped(timescale.seconds(self.timeouts.connect_s)),
        )

    def wall_clock(self, real_s: float) -> float:
        """A monotonic deadline for a whole transfer: `real_s` from now, within the attempt."""
        return time.monotonic() + self.capped(real_s)

    def send_file(
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
        deadline = self.wall_clock(timescale.seconds(self.timeouts.upload_budget_s(size)))
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
        timeout = self.timeout(self.timeouts.acceptance_wait_s(), write_s=self.timeouts.upload_budget_s(size))
        return self.call(
            operation, method, path, content=chunks(), headers=all_headers, params=params,
            timeout=timeout, parse=parse, sent_counter=sent,
        )

    def call(
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
            self.record(operation, row, error_class="BreakerOpen", duration=0.0, counted=False)
            raise VendorError(row, operation=operation, error_class="BreakerOpen", retry_after_s=None) from exc
        request_headers = {**self.auth_headers, **(headers or {})}
        started = time.monotonic()
        status: int | None = None
        received = 0
        try:
            request = self.http.build_request(
                method, self.base + path, json=json, content=content, params=params,
                headers=request_headers, timeout=timeout or self.timeout(self.timeouts.status_s),
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
                    result = parse(response) if parse is not None else json_object(response)
            finally:
                response.close()
        except StopUpload:
            raise
        except MalformedResponse as exc:
            row = classify_exception("MalformedResponse")
            self.record(operation, row, status=status, error_class="MalformedResponse",
                         duration=time.monotonic() - started, sent=(sent_counter or [0])[0], received=received,
                         permit=permit)
            raise VendorError(row, operation=operation, status=status, code="malformed_response",
                              error_class="MalformedResponse", detail=str(exc)[:200],
                              bytes_sent=(sent_counter or [0])[0]) from None
        except (httpx.HTTPError, UploadDeadlineExceeded, DownloadDeadlineExceeded, OSError) as exc:
            # Transport failures only: a bug of ours (a NameError in a parser) is not the vendor's
            # ambiguity; it propagates, and the step's guard leaves the task due again.
            row = classify_exception(exc)
            duration = time.monotonic() - started
            error = VendorError(
                row, operation=operation, error_class=type(exc).__name__,
                bytes_sent=(sent_counter or [0])[0],
            )
            self.record(operation, row, error_class=type(exc).__name__, duration=duration,
                         sent=error.bytes_sent, permit=permit)
            raise error from None
        duration = time.monotonic() - started
        sent = (sent_counter or [0])[0]
        if 300 <= status < 400:
            row = classify_status(status)
            location = response.headers.get("Location", "")[:200]
            self.record(operation, row, status=status, duration=duration, sent=sent, received=received,
                         permit=permit, code="redirected")
            raise VendorError(row, operation=operation, status=status, code="redirected", bytes_sent=sent,
                              detail=f"HTTP {status} to {location or '(no Location)'}")
        if status >= 400 or status < 200:
            code, detail = self.error_details(response)
            row = classify_status(status, code)
            retry_after = parse_retry_after(response.headers.get("Retry-After"), date_header=response.headers.get("Date"))
            if status == 429:
                ChannelHealth.objects.filter(pk=self.channel.pk).update(
                    last_rate_limited_at=timezone.now(), last_retry_after_s=retry_after
                )
            self.record(operation, row, status=status, duration=duration, sent=sent, received=received,
                         retry_after=retry_after, permit=permit, code=code)
            raise VendorError(row, operation=operation, status=status, code=code, retry_after_s=retry_after, bytes_sent=sent,
                              detail=detail)
        self.record(operation, _OK, status=status, duration=duration, sent=sent, received=received, permit=permit)
        return result

    def record(
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
        call = new_row(
            VendorCall,
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
            at=timezone.now(),
        )
        # A plain success is written with the step's other calls; anything the breaker weighs (a
        # failure, a slow call, a trial) is written before the breaker reads its window.
        quiet = row.outcome == Outcome.OK and not call.slow and not (permit is not None and permit.trial)
        log_calls([call], now=not quiet)
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



# Successful calls not yet written, in this process: written together (one INSERT) when the step
# ends, when a call the breaker weighs is made, or when this many have gathered.
_unwritten: list[VendorCall] = []
UNWRITTEN_MAX = 50


_unwritten_lock = threading.Lock()


def log_calls(calls: list[VendorCall], *, now: bool = False) -> None:
    with _unwritten_lock:
        _unwritten.extend(calls)
        full = len(_unwritten) >= UNWRITTEN_MAX
    if now or full:
        flush_calls()


def flush_calls() -> None:
    """Write the calls this process made and has not written yet (the step's end calls it)."""
    calls = take_calls()
    if calls:
        insert_rows(calls)


def take_calls() -> list[VendorCall]:
    """The calls not written yet, handed to a caller that writes them (flush_calls, or a task's
    last move with its own statement: `outcomes.task_move`, which `put_back_calls` if that fails)."""
    with _unwritten_lock:
        calls = list(_unwritten)
        del _unwritten[:]
    return calls


def put_back_calls(calls: list[VendorCall]) -> None:
    """Calls whose write was rolled back, to be written again: as new rows (a key an INSERT gave
    them went back with the rollback, and may be another row's by now)."""
    for call in calls:
        call.pk = None
        call._state.adding, call._state.db = True, None
    with _unwritten_lock:
        _unwritten[:0] = calls


def json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        raise MalformedResponse(f"a {response.status_code} whose body is not JSON") from None
    if not isinstance(data, dict):
        raise MalformedResponse(f"a {response.status_code} whose body is not a JSON object")
    return data


def cursor_value(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, int)):
        raise MalformedResponse("a page whose next_cursor is not a string")
    return str(value)


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



def problem_details(response: httpx.Response) -> tuple[str | None, str]:
    """An RFC 9457 problem body: its `code`, and its `detail` for the operator."""
    try:
        body = response.json()
    except ValueError:
        return None, ""
    if not isinstance(body, dict):
        return None, ""
    code = body.get("code")
    detail = body.get("detail")
    return (code[:64] if isinstance(code, str) else None), (detail[:200] if isinstance(detail, str) else "")


def download_to(dest: Path, *, deadline: float | None = None) -> Callable[[httpx.Response], FetchedResult]:
    """Stream a response body to `dest`, hashing as it arrives, within a wall-clock deadline
    (httpx's read timeout is per read: a result dribbled byte by byte would never time out)."""

    def consume(response: httpx.Response) -> FetchedResult:
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        with open(dest, "wb") as out:
            for chunk in response.iter_bytes():  # as it arrives (a chunk size would wait to fill it)
                if deadline is not None and time.monotonic() > deadline:
                    raise DownloadDeadlineExceeded()
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        return FetchedResult(
            sha256=digest.hexdigest(), size=size,
            content_type=response.headers.get("Content-Type", "application/octet-stream"),
            declared_sha256=response.headers.get("X-Content-SHA256"),
        )

    return consume
