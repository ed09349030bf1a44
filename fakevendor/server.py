"""The fake vendor: a real HTTP server on loopback (HTTP/1.1 through h11, and HTTP/2 with prior
knowledge through h2) whose faults happen on the socket — resets with SO_LINGER 0, stalls, slow
reads, lost responses, GOAWAY — not in a mock.

This module is the request pipeline: it parses a request, asks the fault engine which rules act
on it, runs their hooks around the vendor behaviour (fakevendor/native.py for the contract's
`/v1`, fakevendor/assemblyai.py for AssemblyAI's `/v2`, or fakevendor/proxy.py in front of a
real vendor) and journals the exchange. The transports are fakevendor/http1.py and http2.py;
the control API is fakevendor/admin.py; what QA checks is fakevendor/invariants.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import signal
import time
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

from fakevendor import assemblyai, journal
from fakevendor import jobs as J
from fakevendor.admin import AdminAPI
from fakevendor.answers import json_field, problem
from fakevendor.config import ChannelConfig, ServerConfig
from fakevendor.errors import Aborted, ClientGone
from fakevendor.faults import FAULTS, Decision, FaultEngine, RequestFacts
from fakevendor.faults.base import Outcome, supports
from fakevendor.http1 import READ_SIZE, Connection
from fakevendor.http2 import PREFACE, H2Session, H2Stream
from fakevendor.native import NativeDialect
from fakevendor.proxy import Upstream
from fakevendor.store import Store
from fakevendor.transport import Wire

MAX_JSON_BODY = 1024 * 1024


@dataclass
class Request:
    method: str
    target: str
    path: str
    segments: list[str]
    query: dict[str, str]
    headers: dict[str, str]
    channel: str
    route: list[str]
    protocol: str = "HTTP/1.1"
    started: float = field(default_factory=time.monotonic)
    body: bytes = b""
    bytes_in: int = 0
    rule_id: str | None = None
    draw: float | None = None
    client_ref: str | None = None
    job_id: str | None = None
    retry_after: str | None = None
    # The digest of the input this request is about (an upload's body, a job's input), as the
    # vendor itself knows it: ties the journal to files whatever the dialect's references.
    input_sha256: str | None = None
    # What the journal keeps of the answer (fakevendor.journal.Recorded fills it in).
    response: dict[str, Any] | None = None
    cleanup: list[Path] = field(default_factory=list)  # scratch files to remove once answered
    body_cut: str = "reset"  # how a fault cuts the request body after `reset_after` bytes: reset or close

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def dialect(self) -> str:
        """v1 is the native contract; v2 is AssemblyAI's API."""
        return "assemblyai" if self.route[:1] == ["v2"] else "sluice"

    @property
    def endpoint(self) -> str:
        """The route with ids replaced by `*`, e.g. "GET /v1/jobs/*"."""
        parts = ["*" if i == 2 and self.route[:1] in (["v1"], ["v2"]) else p for i, p in enumerate(self.route)]
        return f"{self.method} /" + "/".join(parts)


class FaultContext:
    """What a wire fault may do to the request it acts on (fakevendor.faults.base.Context)."""

    def __init__(self, vendor: FakeVendor, conn: Wire, request: Request, channel: ChannelConfig) -> None:
        self.vendor, self.conn, self.request, self.channel = vendor, conn, request, channel
        self.time_scale = vendor.config.time_scale

    def scaled(self, nominal_ms: float) -> float:
        return self.vendor.scaled(nominal_ms)

    def headers(self, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return self.vendor.headers(self.request.channel, self.channel, extra)

    async def discard_body(self) -> None:
        await self.vendor.discard_body(self.conn, self.request)

    async def respond(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, **options: Any) -> None:
        await self.conn.respond(status, self.headers(headers), body, **options)

    async def problem(self, status: int, code: str, detail: str, *, retryable: bool = False,
                      extra: list[tuple[str, str]] | None = None) -> int:
        return await self.vendor.problem(self.conn, self.request, status, code, detail, retryable=retryable, extra=extra)

    async def rate_limit_answer(self, *, retry_after_s: float, status: int, as_date: bool = False) -> int:
        return await self.vendor.rate_limit_answer(self.conn, self.request, retry_after_s=retry_after_s, status=status,
                                                   as_date=as_date)


class FakeVendor:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = Store(config.data_dir)
        self.faults = FaultEngine(seed=config.seed)
        self.buckets: dict[str, list[float]] = {}
        self.uploads_now: dict[str, int] = {}
        self.uploads_max: dict[str, int] = {}
        self.requests_now: dict[int, Request] = {}  # being answered now, for /__admin/in-flight
        self.native = NativeDialect(self)
        self.assemblyai = assemblyai.AssemblyAIDialect(self)
        self.upstream = Upstream.configured(config)  # proxy, record or playback mode (else None)
        self.admin = AdminAPI(self)
        self.server: asyncio.AbstractServer | None = None
        self._callback_client = None

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._serve, host=self.config.host, port=self.config.port, backlog=1024, limit=READ_SIZE
        )
        sock = self.server.sockets[0]
        self.config.port = sock.getsockname()[1]
        asyncio.get_running_loop().create_task(self._ticker())

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(0.02)
            try:
                self.store.flush()
                await self._deliver_callbacks()
            except Exception:
                pass

    def scaled(self, nominal_ms: float) -> float:
        """Real seconds for a duration given in nominal milliseconds."""
        return nominal_ms / 1000.0 * self.config.time_scale

    # --- connection handling -------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # HTTP/2 with prior knowledge starts with a fixed preface; anything else is HTTP/1.1.
        start = b""
        try:
            while len(start) < len(PREFACE) and PREFACE.startswith(start):
                chunk = await reader.read(len(PREFACE) - len(start))
                if not chunk:
                    break
                start += chunk
        except (ConnectionError, asyncio.CancelledError):
            writer.close()
            return
        if start == PREFACE:
            await H2Session(reader, writer, self._serve_stream).run(start)
            return
        conn = Connection(reader, writer)
        conn.h11.receive_data(start)
        try:
            while not conn.closed:
                event = await conn.next_event()
                if isinstance(event, h11.Request):
                    request = self._parse(event)
                    await self._handle(conn, request)
                    if conn.closed:
                        break
                    if conn.h11.their_state is h11.SEND_BODY:
                        # The handler answered without reading the body: drain it.
                        await conn.read_body(request)
                    if conn.h11.our_state is h11.MUST_CLOSE or conn.h11.their_state is h11.MUST_CLOSE:
                        break
                    try:
                        conn.h11.start_next_cycle()
                    except h11.LocalProtocolError:
                        break
                elif isinstance(event, h11.ConnectionClosed):
                    break
                else:
                    break
        except (ClientGone, Aborted, ConnectionError, OverflowError):
            pass
        except asyncio.CancelledError:
            # The server is shutting down with this connection open: end it quietly.
            pass
        except h11.RemoteProtocolError as exc:
            status = getattr(exc, "error_status_hint", 400)
            try:
                writer.write(f"HTTP/1.1 {status} Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
                await writer.drain()
            except ConnectionError:
                pass
        finally:
            if not conn.closed:
                conn.close()

    async def _serve_stream(self, stream: H2Stream, raw_headers: list[tuple[str, str]]) -> None:
        """One HTTP/2 stream: the same handlers as HTTP/1.1."""
        pseudo = {k: v for k, v in raw_headers if k.startswith(":")}
        headers = {k.lower(): v for k, v in raw_headers if not k.startswith(":")}
        request = self._request(pseudo.get(":method", "GET"), pseudo.get(":path", "/"), headers)
        request.protocol = "HTTP/2"
        try:
            await self._handle(stream, request)
        except (ClientGone, Aborted, ConnectionError, OverflowError):
            pass

    def _parse(self, event: h11.Request) -> Request:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        return self._request(event.method.decode(), event.target.decode("latin-1"), headers)

    def _request(self, method: str, target: str, headers: dict[str, str]) -> Request:
        split = urlsplit(target)
        segments = [s for s in split.path.split("/") if s]
        query = {k: v[0] for k, v in parse_qs(split.query).items()}
        if segments[:1] in (["v1"], ["v2"], ["__admin"]):
            channel, route = "default", segments
        elif len(segments) >= 2 and segments[1] in ("v1", "v2"):
            channel, route = segments[0], segments[1:]
        else:
            channel, route = "default", segments
        request = Request(
            method=method, target=target, path=split.path, segments=segments,
            query=query, headers=headers, channel=channel, route=route,
        )
        if len(route) >= 3 and route[:2] in (["v1", "jobs"], ["v2", "transcript"]):
            # Known before any fault acts, so the journal ties even a refused read to its job.
            request.job_id = route[2]
        return request

    async def _handle(self, conn: Wire, request: Request) -> None:
        if request.route[:1] == ["__admin"]:
            await self.admin.handle(conn, request)
            return
        if self.upstream is None and request.route[:1] not in (["v1"], ["v2"]):
            await self.problem(conn, request, 404, "not_found", "No such endpoint.")
            return
        outcome = "ok"
        status: int | None = None
        self.requests_now[id(request)] = request
        try:
            status, outcome = await self._vendor(journal.Recorded(conn, request), request)
        except ClientGone:
            outcome = "client_gone"
            raise
        except Aborted as exc:
            outcome = str(exc) or "aborted"
            raise
        except asyncio.CancelledError:
            # An HTTP/2 stream above a GOAWAY's last-stream-id, or the server shutting down.
            outcome = "cut_off"
            raise
        finally:
            self.requests_now.pop(id(request), None)
            self.store.journal(self._journal_entry(request, status, outcome))
            for path in request.cleanup:
                path.unlink(missing_ok=True)

    def _journal_entry(self, request: Request, status: int | None, outcome: str) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "")
        if request.body:
            body = journal.body_summary(request.body, content_type)
        else:  # a file streamed to disk (or no body): its digest and size only
            body = journal.body_summary(None, content_type, sha256=request.input_sha256, size=request.bytes_in)
        sent = {"method": request.method, "target": journal.redact_target(request.target),
                "headers": journal.redact_headers(request.headers),
                "body": body}
        return {
            "at": time.time(), "method": request.method, "path": request.path,
            "channel": request.channel, "endpoint": request.endpoint, "rule_id": request.rule_id,
            "draw": request.draw, "bytes_in": request.bytes_in, "status": status, "outcome": outcome,
            "client_ref": request.client_ref, "idempotency_key": request.headers.get("idempotency-key"),
            "job_id": request.job_id, "retry_after": request.retry_after,
            "input_sha256": request.input_sha256 or request.headers.get("x-content-sha256"),
            "duration_ms": int((time.monotonic() - request.started) * 1000),
            "protocol": request.protocol, "request": json.dumps(sent),
            "response": json.dumps(request.response) if request.response else None,
        }

    # --- the vendor pipeline ------------------------------------------------------------------
    async def _vendor(self, conn: Wire, request: Request) -> Outcome:
        channel = self.config.channel(request.channel)
        if self.upstream is None and not self._authorized(request):
            if request.dialect == "assemblyai":
                await self.discard_body(conn, request)
            return await self.problem(conn, request, 401, "unauthenticated", "Missing or unknown API key."), "ok"
        is_json = request.headers.get("content-type", "").startswith("application/json")
        if request.method in ("POST", "PUT", "PATCH") and is_json:
            if (request.content_length or 0) > MAX_JSON_BODY:
                return await self.problem(conn, request, 413, "file_too_large", "JSON body too large."), "ok"
            chunks: list[bytes] = []
            await conn.read_body(request, sink=chunks.append, limit=MAX_JSON_BODY)
            request.body = b"".join(chunks)
        if request.dialect == "sluice":
            request.client_ref = (
                request.query.get("client_ref") or json_field(request.body, "client_ref") or request.headers.get("x-client-ref")
            )
        kind = request.query.get("kind") or json_field(request.body, "kind")
        facts = RequestFacts(
            method=request.method, path=request.route, channel=request.channel,
            headers=request.headers, client_ref=request.client_ref, kind=kind,
        )
        ctx = FaultContext(self, conn, request, channel)
        chain, wire = self.faults.decide_chain(facts)
        if wire:
            request.rule_id, request.draw = wire.rule_id, wire.draw
            wire = wire if wire.applied else None
        if chain:
            # Stacked latencies first, in their order; the journal names the whole chain.
            request.rule_id = "+".join([*(d.rule_id for d in chain), *([request.rule_id] if request.rule_id else [])])
        for link in [*chain, *([wire] if wire else [])]:
            early = await FAULTS[link.type].before(ctx, link)
            if early is not None:
                return early
        limited = self._rate_limited(request.channel, channel)
        if limited is not None:
            await self.discard_body(conn, request)
            return await self.rate_limit_answer(conn, request, retry_after_s=limited, status=429), "rate_limited"
        fault = FAULTS[wire.type] if wire else None
        reading = fault.reading(wire, self.config.time_scale) if fault else {}
        request.body_cut = reading.get("cut", "reset")
        if self.upstream is not None:
            backend: Any = self.upstream
        else:
            backend = self.assemblyai if request.dialect == "assemblyai" else self.native
        status, headers, body = await backend.route(conn, request, channel, facts, bandwidth=reading.get("bytes_per_s"),
                                                    reset_after=reading.get("reset_after"))
        if fault is not None and supports(conn, fault):
            done = await fault.answer(ctx, wire, status, headers, body)
            if done is not None:
                return done
        await ctx.respond(status, headers, body)
        return status, "ok"

    def _authorized(self, request: Request) -> bool:
        if request.dialect == "assemblyai":
            return assemblyai.authorized(request.headers, self.config.api_keys)
        auth = request.headers.get("authorization", "")
        return auth.startswith("Bearer ") and auth[7:] in self.config.api_keys

    # --- what both dialects share ---------------------------------------------------------------
    def create_effect(self, facts: RequestFacts, request: Request) -> dict[str, Any]:
        """How this create behaves under the create-family rule it matched (copies, keys ignored)."""
        create = self.faults.decide(facts, "create")
        if create is not None and request.rule_id is None:
            request.rule_id, request.draw = create.rule_id, create.draw
        if create is None or not create.applied:
            return {}
        return FAULTS[create.type].on_create(create.params)

    def job_fault(self, facts: RequestFacts, request: Request) -> Decision | None:
        """The job-family rule that shapes the job this create makes, if one fires."""
        decision = self.faults.decide(facts, "job")
        if decision is not None and request.rule_id is None:
            request.rule_id, request.draw = decision.rule_id, decision.draw
        return decision if decision is not None and decision.applied else None

    async def discard_body(self, conn: Wire, request: Request) -> None:
        if conn.body_pending:
            await conn.read_body(request)

    def _rate_limited(self, name: str, channel: ChannelConfig) -> float | None:
        """Token bucket per channel; seconds (nominal) until a token, or None when admitted."""
        if channel.rate_limit_per_s <= 0:
            return None
        rate = channel.rate_limit_per_s / self.config.time_scale
        now = time.monotonic()
        tokens, last = self.buckets.get(name, [float(channel.rate_limit_burst), now])
        tokens = min(channel.rate_limit_burst, tokens + (now - last) * rate)
        if tokens >= 1:
            self.buckets[name] = [tokens - 1, now]
            return None
        self.buckets[name] = [tokens, now]
        return max(1.0, math.ceil((1 - tokens) / channel.rate_limit_per_s))

    async def rate_limit_answer(
        self, conn: Wire, request: Request, *, retry_after_s: float, status: int, as_date: bool = False
    ) -> int:
        seconds = max(int(math.ceil(retry_after_s)), 0)
        value = formatdate(time.time() + seconds, usegmt=True) if as_date else str(seconds)
        request.retry_after = value
        code = "rate_limited" if status == 429 else "unavailable"
        await self.problem(conn, request, status, code, "Slow down and retry later.", retryable=True,
                            extra=[("Retry-After", value)])
        return status

    def headers(self, name: str, channel: ChannelConfig, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if self.upstream is not None:
            return list(extra)  # a proxy passes the upstream's own headers
        if channel.rate_limit_per_s > 0:
            tokens = self.buckets.get(name, [float(channel.rate_limit_burst), 0])[0]
            limit, remaining = channel.rate_limit_burst, max(int(tokens), 0)
            reset = math.ceil((channel.rate_limit_burst - tokens) / channel.rate_limit_per_s)
        else:
            limit, remaining, reset = 10000, 10000, 0
        return [
            *extra,
            ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Remaining", str(remaining)),
            ("X-RateLimit-Reset", str(reset)),
        ]

    async def problem(
        self,
        conn: Wire,
        request: Request,
        status: int,
        code: str,
        detail: str,
        *,
        retryable: bool = False,
        extra: list[tuple[str, str]] | None = None,
    ) -> int:
        channel = self.config.channel(request.channel)
        if request.dialect == "assemblyai":
            # AssemblyAI's errors carry only a message.
            body = json.dumps({"error": detail}).encode()
            headers = self.headers(request.channel, channel, [("Content-Type", "application/json"), *(extra or [])])
            await conn.respond(status, headers, body)
            return status
        _, kind, body = problem(status, code, detail, retryable=retryable, extra=extra)
        await conn.respond(status, self.headers(request.channel, channel, kind), body)
        return status

    async def receive_file(
        self, conn: Wire, request: Request, channel: ChannelConfig, *, bandwidth: float | None,
        reset_after: int | None,
    ) -> tuple[Path, int, str] | tuple[int, list, bytes]:
        length = request.content_length
        if length is None:
            return problem(411, "length_required", "Send Content-Length with the file.")
        if length > channel.max_upload_bytes:
            return problem(413, "file_too_large", f"Files up to {channel.max_upload_bytes} bytes.")
        path = self.store.dir / "uploads" / f"tmp-{uuid.uuid4().hex}"
        digest = hashlib.sha256()
        name = request.channel
        self.uploads_now[name] = self.uploads_now.get(name, 0) + 1
        self.uploads_max[name] = max(self.uploads_max.get(name, 0), self.uploads_now[name])
        try:
            with open(path, "wb") as out:
                def sink(chunk: bytes) -> None:
                    digest.update(chunk)
                    out.write(chunk)

                size = await conn.read_body(request, sink=sink, bytes_per_s=bandwidth, reset_after=reset_after)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            self.uploads_now[name] -= 1
        sha = digest.hexdigest()
        request.input_sha256 = sha
        declared = request.headers.get("x-content-sha256")
        if declared and declared.lower() != sha:
            path.unlink(missing_ok=True)
            return problem(400, "digest_mismatch", "X-Content-SHA256 does not match the body.")
        return path, size, sha

    def running_jobs(self, name: str) -> int:
        now = time.time()
        rows = self.store.query(
            "SELECT start_at, end_at, canceled_at FROM jobs WHERE channel = ? AND end_at > ?", (name, now)
        )
        return sum(1 for r in rows if r["canceled_at"] is None or r["canceled_at"] > now)

    def new_job(self, name, channel: ChannelConfig, fields, options, key, input_path: Path, size, sha,
                job_rule: Decision | None, *, extra: dict[str, Any] | None = None, bill: bool = True,
                fail_code: str | None = None):
        """A new job (billed at once, as real vendors do), under `extra` for another dialect."""
        now = time.time()
        job_id = str(uuid.uuid4()) if extra else f"job_{uuid.uuid4().hex[:20]}"
        start = now + self.scaled(channel.queue_ms)
        if channel.max_concurrent_jobs and channel.concurrency_mode == "queue":
            ends = sorted(
                r["end_at"] for r in self.store.query(
                    "SELECT end_at FROM jobs WHERE channel = ? AND end_at > ? AND canceled_at IS NULL", (name, now)
                )
            )
            if len(ends) >= channel.max_concurrent_jobs:
                start = max(start, ends[len(ends) - channel.max_concurrent_jobs])
        duration = self.scaled(channel.processing_ms)
        job: dict[str, Any] = {
            "id": job_id, "channel": name, "kind": fields["kind"], "target_format": fields["target_format"],
            "client_ref": fields["client_ref"], "idempotency_key": key or "", "options": json.dumps(options, sort_keys=True),
            "input_size": size, "input_sha256": sha, "input_path": str(input_path), "callback_url": fields["callback_url"],
            "created_at": now, "start_at": start, "end_at": start + duration, "canceled_at": None,
            "fail_code": fail_code, "fail_retryable": 0, "digest_mismatch": 0, "input_digest_mismatch": 0,
            "not_found_until": 0, "extra": json.dumps(extra) if extra else "",
        }
        if job_rule is not None:
            FAULTS[job_rule.type].on_job(job, job_rule.params, self.scaled, now)
        units, unit = J.billing_units(fields["kind"], input_path, size) if bill else (0.0, "audio_minute")
        job["units"], job["unit"] = units, unit
        job["amount_cents"] = int(round(units * channel.price_cents.get(unit, 1)))
        self.store.insert_job(job)
        if bill:
            self.store.add_ledger_entry(
                {"entry_id": f"le_{uuid.uuid4().hex[:20]}", "channel": name, "job_id": job_id,
                 "client_ref": fields["client_ref"], "idempotency_key": key or "", "units": units, "unit": unit,
                 "amount_cents": job["amount_cents"], "created_at": now, "input_sha256": sha}
            )
        return job

    # --- callbacks ------------------------------------------------------------------------
    async def _deliver_callbacks(self) -> None:
        now = time.time()
        rows = self.store.query(
            "SELECT * FROM jobs WHERE callback_url != '' AND callback_state IN ('', 'retry')"
            " AND callback_next_at <= ? AND (end_at <= ? OR (canceled_at IS NOT NULL AND canceled_at <= ?)) LIMIT 20",
            (now, now, now),
        )
        if not rows:
            return
        import httpx

        if self._callback_client is None:
            self._callback_client = httpx.AsyncClient(timeout=2.0, follow_redirects=False, trust_env=False)
        for row in rows:
            job = dict(row)
            dialect = self.assemblyai if assemblyai._extra(job).get("dialect") == "assemblyai" else self.native
            body, headers = dialect.callback(job, now)
            attempts = job["callback_attempts"] + 1
            try:
                response = await self._callback_client.post(job["callback_url"], content=body, headers=headers)
                ok = response.status_code < 300
                retry = not ok and response.status_code >= 500
            except Exception:
                ok, retry = False, True
            limit = self.config.channel(job["channel"]).callback_attempts
            state = "delivered" if ok else ("retry" if retry and attempts < limit else "failed")
            self.store.update_job(job["id"], callback_state=state, callback_attempts=attempts,
                                  callback_next_at=now + self.scaled(500 * 2 ** attempts))

    def requests_in_flight(self) -> list[dict[str, Any]]:
        """The vendor requests being answered at this moment (the journal holds them once they end):
        what a QA engineer looks at to act while a download or an upload is under way."""
        now = time.monotonic()
        return [
            {"method": r.method, "path": r.path, "endpoint": r.endpoint, "channel": r.channel, "job_id": r.job_id,
             "client_ref": r.client_ref, "rule_id": r.rule_id, "bytes_in": r.bytes_in, "protocol": r.protocol,
             "age_ms": int((now - r.started) * 1000)}
            for r in sorted(self.requests_now.values(), key=lambda r: r.started)
        ]


def run(config: ServerConfig, *, rules: list[dict[str, Any]] | None = None, ready_file: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM."""

    async def main() -> None:
        vendor = FakeVendor(config)
        for rule in rules or []:
            vendor.faults.add(rule)
        await vendor.start()
        mode = f" ({vendor.upstream.mode} of {config.upstream or config.playback})" if vendor.upstream else ""
        print(f"fake vendor listening on http://{config.host}:{config.port}{mode}", flush=True)
        if ready_file:
            Path(ready_file).write_text(str(config.port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        vendor.store.flush()
        vendor.server.close()

    asyncio.run(main())
