"""The fake vendor: a real HTTP server on loopback (asyncio + h11, and HTTP/2 with prior knowledge
through h2) whose faults happen on the socket — resets with SO_LINGER 0, stalls, slow reads, lost
responses, GOAWAY — not in a mock.

It implements shared/contracts/vendor-api.md for any number of channels (path prefixes) and the
/__admin/ control API (faults, seed, reset, journal, invariants, channels).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import signal
import socket
import struct
import time
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11

from fakevendor import assemblyai
from fakevendor import jobs as J
from fakevendor.config import ChannelConfig, ServerConfig
from fakevendor.errors import Aborted, ClientGone
from fakevendor.faults import Decision, FaultEngine, RequestFacts, RuleError
from fakevendor.http2 import PREFACE, H2Session, H2Stream
from fakevendor.pacing import paced
from fakevendor.store import Store

READ_SIZE = 64 * 1024

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


class Connection:
    """One client connection: h11 state plus the socket-level fault primitives."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self.closed = False

    @property
    def body_pending(self) -> bool:
        return self.h11.their_state is h11.SEND_BODY

    async def next_event(self) -> Any:
        """The next request (a malformed one raises h11.RemoteProtocolError: answered 400)."""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(READ_SIZE)
                self.h11.receive_data(data)
                continue
            return event

    async def read_body(
        self,
        request: Request,
        *,
        sink: Any = None,
        bytes_per_s: float | None = None,
        reset_after: int | None = None,
        limit: int | None = None,
    ) -> int:
        """Read the request body to the end; return its size. Applies bandwidth and mid-body resets."""
        total = 0
        if bytes_per_s:
            # A small receive buffer, so the client feels the slow link instead of filling ours.
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                request.bytes_in = total
                raise ClientGone() from None
            if event is h11.NEED_DATA:
                size = READ_SIZE
                if bytes_per_s:
                    size = max(512, min(READ_SIZE, int(bytes_per_s / 20)))
                if reset_after is not None:
                    size = max(1, min(size, reset_after - total))
                data = await self.reader.read(size)
                self.h11.receive_data(data)
                continue
            if isinstance(event, h11.Data):
                chunk = bytes(event.data)
                if bytes_per_s:
                    # Throttle what we consume, including bytes already buffered with the headers.
                    await asyncio.sleep(len(chunk) / bytes_per_s)
                if reset_after is not None and total + len(chunk) >= reset_after:
                    request.bytes_in = reset_after
                    self.reset()
                    raise Aborted("reset mid-body")
                total += len(chunk)
                if limit is not None and total > limit:
                    request.bytes_in = total
                    raise OverflowError()
                if sink is not None:
                    sink(chunk)
                continue
            if isinstance(event, h11.EndOfMessage):
                request.bytes_in = total
                return total
            request.bytes_in = total
            raise ClientGone()

    async def respond(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes | Path = b"",
        *,
        dribble: tuple[int, float] | None = None,
        close: bool = False,
        bytes_per_s: float | None = None,
    ) -> None:
        size = body.stat().st_size if isinstance(body, Path) else len(body)
        all_headers = [*headers, ("Content-Length", str(size)), ("Date", formatdate(usegmt=True))]
        if close:
            all_headers.append(("Connection", "close"))
        self._write(h11.Response(status_code=status, headers=all_headers, reason=_reason(status)))
        if bytes_per_s:
            # A bandwidth limit on the answer: pieces of a twentieth of a second's worth.
            async for piece in paced(body, bytes_per_s):
                self._write(h11.Data(data=piece))
                await self.writer.drain()
            self._write(h11.EndOfMessage())
            await self.writer.drain()
            return
        if isinstance(body, Path) and dribble:
            body = body.read_bytes()
        if isinstance(body, Path):
            with open(body, "rb") as handle:
                while chunk := handle.read(READ_SIZE):
                    self._write(h11.Data(data=chunk))
                    await self.writer.drain()
        elif dribble and body:
            chunks, total_s = dribble
            step = math.ceil(len(body) / chunks)
            for index in range(0, len(body), step):
                self._write(h11.Data(data=body[index:index + step]))
                await self.writer.drain()
                await asyncio.sleep(total_s / chunks)
        elif body:
            self._write(h11.Data(data=body))
        self._write(h11.EndOfMessage())
        await self.writer.drain()

    async def respond_truncated(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, *, limit: int) -> None:
        """The answer's first `limit` bytes (status line and headers included), then the close."""
        payload = body.read_bytes() if isinstance(body, Path) else body
        wire = self.h11.send(h11.Response(status_code=status, reason=_reason(status), headers=[
            *headers, ("Content-Length", str(len(payload))), ("Date", formatdate(usegmt=True))]))
        wire += self.h11.send(h11.Data(data=payload)) if payload else b""
        self.writer.write(wire[:limit])
        await self.writer.drain()
        self.close()

    async def respond_sliced(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, *, size: int,
                             variation: int, delay_s: float, rng: Any) -> None:
        """The whole answer written in small pieces, each after a delay."""
        payload = body.read_bytes() if isinstance(body, Path) else body
        wire = self.h11.send(h11.Response(status_code=status, reason=_reason(status), headers=[
            *headers, ("Content-Length", str(len(payload))), ("Date", formatdate(usegmt=True))]))
        wire += (self.h11.send(h11.Data(data=payload)) if payload else b"") + self.h11.send(h11.EndOfMessage())
        index = 0
        while index < len(wire):
            piece = max(1, size + (rng.randint(-variation, variation) if variation else 0))
            self.writer.write(wire[index:index + piece])
            await self.writer.drain()
            index += piece
            if index < len(wire):
                await asyncio.sleep(delay_s)

    def _write(self, event: Any) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)

    def reset(self) -> None:
        """A real TCP reset: SO_LINGER with a zero timeout, then close."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.writer.transport.abort()
        self.closed = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()

    async def garbage(self, size: int, rng: Any) -> None:
        self.writer.write(bytes(rng.getrandbits(8) for _ in range(size)))
        await self.writer.drain()
        self.close()

    async def stall_forever(self) -> None:
        """Never answer: hold the connection until the client gives up."""
        while True:
            data = await self.reader.read(READ_SIZE)
            if not data:
                self.close()
                return

    async def goaway(self, *, last_stream_id: int | None = None, error_code: int = 0) -> None:
        """HTTP/1.1 has no GOAWAY: the nearest thing is closing without an answer."""
        self.close()


# What a handler answers through: an HTTP/1.1 connection or one HTTP/2 stream.
Wire = Connection | H2Stream


def _reason(status: int) -> bytes:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class FakeVendor:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = Store(config.data_dir)
        self.faults = FaultEngine(seed=config.seed)
        self.buckets: dict[str, list[float]] = {}
        self.uploads_now: dict[str, int] = {}
        self.uploads_max: dict[str, int] = {}
        self.requests_now: dict[int, Request] = {}  # being answered now, for /__admin/in-flight
        self.assemblyai = assemblyai.AssemblyAIDialect(self)
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
            await self._admin(conn, request)
            return
        if request.route[:1] not in (["v1"], ["v2"]):
            await self._problem(conn, request, 404, "not_found", "No such endpoint.")
            return
        outcome = "ok"
        status: int | None = None
        self.requests_now[id(request)] = request
        try:
            status, outcome = await self._vendor(conn, request)
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
            self.store.journal(
                {
                    "at": time.time(), "method": request.method, "path": request.path,
                    "channel": request.channel, "endpoint": request.endpoint, "rule_id": request.rule_id,
                    "draw": request.draw, "bytes_in": request.bytes_in, "status": status, "outcome": outcome,
                    "client_ref": request.client_ref, "idempotency_key": request.headers.get("idempotency-key"),
                    "job_id": request.job_id, "retry_after": request.retry_after,
                    "input_sha256": request.input_sha256 or request.headers.get("x-content-sha256"),
                    "duration_ms": int((time.monotonic() - request.started) * 1000),
                    "protocol": request.protocol,
                }
            )

    # --- vendor API ------------------------------------------------------------------------
    async def _vendor(self, conn: Wire, request: Request) -> tuple[int | None, str]:
        channel = self.config.channel(request.channel)
        auth = request.headers.get("authorization", "")
        if request.dialect == "assemblyai":
            allowed = assemblyai.authorized(request.headers, self.config.api_keys)
        else:
            allowed = auth.startswith("Bearer ") and auth[7:] in self.config.api_keys
        if not allowed:
            if request.dialect == "assemblyai":
                await self._discard_body(conn, request)
            return await self._problem(conn, request, 401, "unauthenticated", "Missing or unknown API key."), "ok"
        is_json = request.headers.get("content-type", "").startswith("application/json")
        if request.method == "POST" and is_json:
            if (request.content_length or 0) > MAX_JSON_BODY:
                return await self._problem(conn, request, 413, "file_too_large", "JSON body too large."), "ok"
            chunks: list[bytes] = []
            await conn.read_body(request, sink=chunks.append, limit=MAX_JSON_BODY)
            request.body = b"".join(chunks)
        if request.dialect == "sluice":
            request.client_ref = (
                request.query.get("client_ref") or _json_field(request.body, "client_ref") or request.headers.get("x-client-ref")
            )
        kind = request.query.get("kind") or _json_field(request.body, "kind")
        facts = RequestFacts(
            method=request.method, path=request.route, channel=request.channel,
            headers=request.headers, client_ref=request.client_ref, kind=kind,
        )
        chain, wire = self.faults.decide_chain(facts)
        if wire:
            request.rule_id, request.draw = wire.rule_id, wire.draw
            wire = wire if wire.applied else None
        if chain:
            # Stacked latencies first, in their order; the journal names the whole chain.
            request.rule_id = "+".join([*(d.rule_id for d in chain), *([request.rule_id] if request.rule_id else [])])
            for link in chain:
                if await self._wire_before(conn, request, link, channel) is not None:
                    return None, link.type
        if wire:
            early = await self._wire_before(conn, request, wire, channel)
            if early is not None:
                return early
        limited = self._rate_limited(request.channel, channel)
        if limited is not None:
            await self._discard_body(conn, request)
            return await self._rate_limit_answer(conn, request, retry_after_s=limited, status=429), "rate_limited"
        bandwidth = down_bandwidth = None
        reset_after = None
        if wire and wire.type == "bandwidth":
            rate = wire.params["bytes_per_s"] / self.config.time_scale
            direction = wire.params.get("direction", "both")
            bandwidth = rate if direction in ("upstream", "both") else None  # the request body
            down_bandwidth = rate if direction in ("downstream", "both") else None  # the answer
        if wire and wire.type == "reset" and wire.params.get("stage") == "mid_body":
            reset_after = int(wire.params["after_bytes"])
        if request.dialect == "assemblyai":
            answer = await self.assemblyai.route(conn, request, channel, facts, bandwidth=bandwidth, reset_after=reset_after)
        else:
            answer = await self._route(conn, request, channel, facts, bandwidth=bandwidth, reset_after=reset_after)
        status, headers, body = answer
        if wire and wire.type == "malformed":
            # Processed (a create is billed), then answered with a success nobody can read.
            good = status if 200 <= status < 300 else 200
            code = int(wire.params.get("status", good))
            garbled = _malformed_body(wire.params.get("body", "not_json"), body)
            await conn.respond(code, self._headers(request.channel, channel, [("Content-Type", "application/json")]), garbled)
            return code, f"malformed:{wire.params.get('body', 'not_json')}"
        if wire and wire.type == "response_lost":
            mode = wire.params.get("mode", "reset")
            if mode == "reset":
                conn.reset()
            elif mode == "close":
                conn.close()
            elif mode == "goaway":
                # "I may have processed your request": last-stream-id covers this stream.
                await conn.goaway(last_stream_id=getattr(conn, "stream_id", None),
                                  error_code=int(wire.params.get("error_code", 0)))
            else:
                await conn.stall_forever()
            return status, f"response_lost:{mode}"
        if wire and wire.type == "limit_data" and isinstance(conn, Connection):
            # Processed, then the answer stops after N bytes (status line and headers count) and
            # the connection closes: the client holds a truncated answer.
            await conn.respond_truncated(status, self._headers(request.channel, channel, headers), body,
                                         limit=int(wire.params["bytes"]))
            return status, "limit_data"
        dribble = None
        if wire and wire.type == "dribble":
            dribble = (int(wire.params["chunks"]), self.scaled(wire.params["total_ms"]))
        if wire and wire.type == "slicer" and isinstance(conn, Connection):
            # Toxiproxy's slicer on the whole answer, status line and headers included: a client
            # whose timeouts are per read never times out while the pieces keep coming.
            params = wire.params
            await conn.respond_sliced(status, self._headers(request.channel, channel, headers), body,
                                      size=int(params.get("average_size", 1)), variation=int(params.get("size_variation", 0)),
                                      delay_s=self.scaled(params.get("delay_ms", 1000)), rng=wire.rng)
            return status, "slicer"
        slow_close = wire is not None and wire.type == "slow_close" and isinstance(conn, Connection)
        await conn.respond(status, self._headers(request.channel, channel, headers), body, dribble=dribble,
                           bytes_per_s=down_bandwidth, close=slow_close)
        if slow_close:
            # The whole answer was sent; the server lingers before it closes (Toxiproxy's slow_close).
            await asyncio.sleep(self.scaled(wire.params["ms"]))
            conn.close()
            return status, "slow_close"
        return status, "dribble" if dribble else "bandwidth" if down_bandwidth else "ok"

    async def _wire_before(
        self, conn: Wire, request: Request, wire: Decision, channel: ChannelConfig
    ) -> tuple[int | None, str] | None:
        """Faults that act before the request is processed. None: go on processing."""
        kind, params = wire.type, wire.params
        if kind == "reset" and params.get("stage", "before_body") == "before_body":
            conn.reset()
            return None, "reset"
        if kind == "stall":
            if params.get("ms") is None:
                await conn.stall_forever()
                return None, "stall"
            await asyncio.sleep(self.scaled(params["ms"]))
            return None
        if kind == "delay":
            await asyncio.sleep(self.scaled(_delay_ms(params, wire.rng)))
            return None
        if kind == "http_error":
            await self._discard_body(conn, request)
            status = int(params["status"])
            code = params.get("code") or f"http_{status}"
            body = params.get("body")
            if body is not None:
                payload = body if isinstance(body, str) else json.dumps(body)
                await conn.respond(status, self._headers(request.channel, channel, [("Content-Type", "application/json")]), payload.encode())
            else:
                await self._problem(conn, request, status, code, "Injected error.", retryable=status >= 500)
            return status, "http_error"
        if kind == "rate_limit":
            await self._discard_body(conn, request)
            status = int(params.get("status", 429))
            seconds = params.get("retry_after_s", 1)
            await self._rate_limit_answer(
                conn, request, retry_after_s=seconds, status=status, as_date=bool(params.get("retry_after_date"))
            )
            return status, "rate_limited"
        if kind == "redirect":
            # Not processed: a vendor (or a proxy in front of it) pointing elsewhere.
            await self._discard_body(conn, request)
            status = int(params.get("status", 302))
            location = params.get("location") or f"http://127.0.0.1:1{request.path}"
            await conn.respond(status, self._headers(request.channel, channel, [("Location", location)]), b"")
            return status, "redirect"
        if kind == "close":
            await self._discard_body(conn, request)
            conn.close()
            return None, "close"
        if kind == "garbage":
            await self._discard_body(conn, request)
            await conn.garbage(int(params.get("bytes", 64)), wire.rng)
            return None, "garbage"
        if kind == "timeout":
            # Toxiproxy's timeout: nothing passes (the request is not processed), then the close.
            if not params.get("ms"):
                await conn.stall_forever()
                return None, "timeout"
            await asyncio.sleep(self.scaled(params["ms"]))
            conn.close()
            return None, "timeout"
        if kind == "reset_peer":
            await asyncio.sleep(self.scaled(params["ms"]))
            conn.reset()
            return None, "reset_peer"
        if kind == "goaway":
            # Refused before processing: with the default last-stream-id the client may resend.
            await conn.goaway(last_stream_id=params.get("last_stream_id"), error_code=int(params.get("error_code", 0)))
            return None, "goaway"
        return None

    async def _discard_body(self, conn: Wire, request: Request) -> None:
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

    async def _rate_limit_answer(
        self, conn: Wire, request: Request, *, retry_after_s: float, status: int, as_date: bool = False
    ) -> int:
        seconds = max(int(math.ceil(retry_after_s)), 0)
        value = formatdate(time.time() + seconds, usegmt=True) if as_date else str(seconds)
        request.retry_after = value
        code = "rate_limited" if status == 429 else "unavailable"
        await self._problem(conn, request, status, code, "Slow down and retry later.", retryable=True,
                            extra=[("Retry-After", value)])
        return status

    def _headers(self, name: str, channel: ChannelConfig, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
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

    async def _problem(
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
            headers = self._headers(request.channel, channel, [("Content-Type", "application/json"), *(extra or [])])
            await conn.respond(status, headers, body)
            return status
        body = json.dumps(
            {"type": f"https://sluice.invalid/vendor/{code}", "title": _reason(status).decode() or code,
             "status": status, "code": code, "detail": detail, "retryable": retryable}
        ).encode()
        headers = self._headers(request.channel, channel, [("Content-Type", "application/problem+json"), *(extra or [])])
        await conn.respond(status, headers, body)
        return status

    async def _route(
        self, conn: Wire, request: Request, channel: ChannelConfig, facts: RequestFacts,
        *, bandwidth: float | None, reset_after: int | None,
    ) -> tuple[int, list[tuple[str, str]], bytes | Path]:
        route, method = request.route, request.method
        if route == ["v1", "uploads"] and method == "POST":
            return await self._upload(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
        if route == ["v1", "jobs"] and method == "POST":
            return await self._create(conn, request, channel, facts, bandwidth=bandwidth, reset_after=reset_after)
        if route == ["v1", "jobs"] and method == "GET":
            return self._list(request)
        if route == ["v1", "usage"] and method == "GET":
            return self._usage(request)
        if len(route) >= 3 and route[:2] == ["v1", "jobs"]:
            request.job_id = route[2]
            if len(route) == 3 and method == "GET":
                return self._get(request)
            if route[3:] == ["result"] and method == "GET":
                return self._result(request)
            if route[3:] == ["cancel"] and method == "POST":
                return self._cancel(request, channel)
        await self._discard_body(conn, request)
        return _problem_tuple(404, "not_found", "No such endpoint.")

    async def _receive_file(
        self, conn: Wire, request: Request, channel: ChannelConfig, *, bandwidth: float | None,
        reset_after: int | None,
    ) -> tuple[Path, int, str] | tuple[int, list, bytes]:
        length = request.content_length
        if length is None:
            return _problem_tuple(411, "length_required", "Send Content-Length with the file.")
        if length > channel.max_upload_bytes:
            return _problem_tuple(413, "file_too_large", f"Files up to {channel.max_upload_bytes} bytes.")
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
            return _problem_tuple(400, "digest_mismatch", "X-Content-SHA256 does not match the body.")
        return path, size, sha

    async def _upload(self, conn: Wire, request: Request, channel: ChannelConfig, *, bandwidth, reset_after):
        received = await self._receive_file(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
        if isinstance(received[0], int):
            return received
        path, size, sha = received
        upload_id = f"up_{uuid.uuid4().hex[:20]}"
        final = path.with_name(upload_id)
        path.rename(final)
        now = time.time()
        expires = now + channel.upload_ttl_s * self.config.time_scale
        self.store.execute(
            "INSERT INTO uploads (id, channel, size, sha256, path, created_at, expires_at) VALUES (?,?,?,?,?,?,?)",
            (upload_id, request.channel, size, sha, str(final), now, expires),
        )
        return 201, [("Content-Type", "application/json")], _json(
            {"upload_id": upload_id, "size": size, "sha256": sha, "expires_at": J.rfc3339(expires)}
        )

    async def _create(self, conn, request, channel: ChannelConfig, facts: RequestFacts, *, bandwidth, reset_after):
        name = request.channel
        key = request.headers.get("idempotency-key")
        if key is not None and (not key or len(key) > 255):
            await self._discard_body(conn, request)
            return _problem_tuple(400, "invalid_request", "Idempotency-Key must be 1-255 characters.")
        create = self.faults.decide(facts, "create")
        if create is not None and request.rule_id is None:
            request.rule_id, request.draw = create.rule_id, create.draw
        create = create if create is not None and create.applied else None
        ignore_keys = create is not None and create.type == "ignore_idempotency"
        copies = 1
        if create is not None and create.type in ("duplicate_create", "duplicate_on_create"):
            # One request, several billed jobs: a vendor bug (unlike ignore_idempotency, no resend needed).
            copies = int(create.params.get("copies", 2))
        inline = not request.headers.get("content-type", "").startswith("application/json")
        existing = None
        if key and not ignore_keys:
            rows = self.store.query("SELECT * FROM idempotency WHERE channel = ? AND key = ?", (name, key))
            existing = dict(rows[0]) if rows else None
            if existing and existing["state"] == "in_progress":
                await self._discard_body(conn, request)
                return _problem_tuple(409, "idempotency_key_in_use", "A request with this key is in flight.",
                                      retryable=True, extra=[("Retry-After", "1")])
            if existing is None:
                self.store.execute(
                    "INSERT INTO idempotency (channel, key, fingerprint, job_id, state, created_at) VALUES (?,?,?,?,?,?)",
                    (name, key, "", "", "in_progress", time.time()),
                )
        try:
            answer = await self._create_job(
                conn, request, channel, facts, key=key, existing=existing, inline=inline, copies=copies,
                ignore_keys=ignore_keys, bandwidth=bandwidth, reset_after=reset_after,
            )
        except BaseException:
            if key and not ignore_keys and existing is None:
                self.store.execute("DELETE FROM idempotency WHERE channel = ? AND key = ? AND state = 'in_progress'", (name, key))
            raise
        if key and not ignore_keys and existing is None and answer[0] != 201:
            # Validation failures are not stored: the client may fix the request and retry.
            self.store.execute("DELETE FROM idempotency WHERE channel = ? AND key = ? AND state = 'in_progress'", (name, key))
        return answer

    async def _create_job(self, conn, request, channel, facts, *, key, existing, inline, copies, ignore_keys, bandwidth, reset_after):
        name = request.channel
        if inline:
            params = request.query
            received = await self._receive_file(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
            if isinstance(received[0], int):
                return received
            input_path, size, sha = received
            fields = {
                "kind": params.get("kind"), "target_format": params.get("target_format"),
                "client_ref": params.get("client_ref") or "", "callback_url": params.get("callback_url") or "",
            }
            try:
                options = json.loads(params["options"]) if params.get("options") else {}
            except ValueError:
                options = None
        else:
            try:
                body = json.loads(request.body or b"{}")
            except ValueError:
                return _problem_tuple(400, "invalid_request", "The body is not valid JSON.")
            if not isinstance(body, dict):
                return _problem_tuple(400, "invalid_request", "The body must be a JSON object.")
            fields = {k: body.get(k) for k in ("kind", "target_format", "client_ref", "callback_url")}
            fields["client_ref"] = fields["client_ref"] or ""
            fields["callback_url"] = fields["callback_url"] or ""
            options = body.get("options") or {}
            rows = self.store.query("SELECT * FROM uploads WHERE id = ? AND channel = ?", (body.get("upload_id") or "", name))
            if not rows or rows[0]["expires_at"] < time.time():
                return _problem_tuple(404, "upload_not_found", "Upload first (POST /v1/uploads); uploads expire.")
            input_path, size, sha = Path(rows[0]["path"]), rows[0]["size"], rows[0]["sha256"]
        if fields["kind"] not in J.KINDS:
            return _problem_tuple(400, "invalid_request", f"kind must be one of {', '.join(J.KINDS)}.")
        if fields["target_format"] not in J.TARGETS[fields["kind"]]:
            return _problem_tuple(415, "unsupported_format", f"target_format for {fields['kind']}: {', '.join(J.TARGETS[fields['kind']])}.")
        if not isinstance(options, dict):
            return _problem_tuple(400, "invalid_request", "options must be a JSON object.")
        if not isinstance(fields["client_ref"], str) or len(fields["client_ref"]) > 200:
            return _problem_tuple(400, "invalid_request", "client_ref must be a string of at most 200 characters.")
        request.client_ref = fields["client_ref"]
        request.input_sha256 = sha
        fp = J.fingerprint(input_sha256=sha, kind=fields["kind"], target_format=fields["target_format"],
                           client_ref=fields["client_ref"], options=options)
        if existing is not None:
            if inline:
                input_path.unlink(missing_ok=True)
            if existing["fingerprint"] != fp:
                return _problem_tuple(422, "idempotency_key_mismatch", "This key was used with a different request.")
            job = self.store.job(name, existing["job_id"])
            request.job_id = job["id"]
            return 200, [("Content-Type", "application/json"), ("Idempotent-Replayed", "true")], _json(self._view(job, time.time()))
        if channel.max_concurrent_jobs and channel.concurrency_mode == "reject":
            if self._running_jobs(name) + copies > channel.max_concurrent_jobs:
                return _problem_tuple(429, "too_many_jobs", "Too many jobs in flight.", retryable=True,
                                      extra=[("Retry-After", "2")])
        job_rules = self.faults.decide(facts, "job")
        if job_rules is not None and request.rule_id is None:
            request.rule_id, request.draw = job_rules.rule_id, job_rules.draw
        job_rules = job_rules if job_rules is not None and job_rules.applied else None
        created = [self._new_job(name, channel, fields, options, key, input_path, size, sha, job_rules) for _ in range(copies)]
        first = created[0]
        request.job_id = first["id"]
        if key and not ignore_keys:
            self.store.execute(
                "UPDATE idempotency SET fingerprint = ?, job_id = ?, state = 'done' WHERE channel = ? AND key = ?",
                (fp, first["id"], name, key),
            )
        return 201, [("Content-Type", "application/json")], _json(self._view(first, time.time()))

    def _running_jobs(self, name: str) -> int:
        now = time.time()
        rows = self.store.query(
            "SELECT start_at, end_at, canceled_at FROM jobs WHERE channel = ? AND end_at > ?", (name, now)
        )
        return sum(1 for r in rows if r["canceled_at"] is None or r["canceled_at"] > now)

    def _new_job(self, name, channel: ChannelConfig, fields, options, key, input_path: Path, size, sha,
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
            params = job_rule.params
            if job_rule.type == "job_fail":
                job["fail_code"] = params.get("code", "processing_failed")
                job["fail_retryable"] = int(bool(params.get("retryable", False)))
            elif job_rule.type == "stuck":
                job["end_at"] += self.scaled(params["ms"])
            elif job_rule.type == "digest_mismatch":
                job["digest_mismatch"] = 1
            elif job_rule.type == "input_digest_mismatch":
                job["input_digest_mismatch"] = 1
            elif job_rule.type == "transient_404":
                job["not_found_until"] = now + self.scaled(params["ms"])
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

    def _job_or_404(self, request: Request) -> dict[str, Any] | tuple:
        job = self.store.job(request.channel, request.job_id or "")
        if job is None or job["not_found_until"] > time.time():
            return _problem_tuple(404, "job_not_found", "No job with this id.")
        return job

    def _get(self, request: Request):
        job = self._job_or_404(request)
        if isinstance(job, tuple):
            return job
        request.client_ref, request.input_sha256 = job["client_ref"], job["input_sha256"]
        return 200, [("Content-Type", "application/json")], _json(self._view(job, time.time()))

    def _list(self, request: Request):
        client_ref = request.query.get("client_ref")
        if not client_ref:
            return _problem_tuple(400, "invalid_request", "client_ref is required.")
        request.client_ref = client_ref
        now = time.time()
        jobs = self.store.jobs_by_client_ref(request.channel, client_ref, request.query.get("status"), now)
        limit = _int(request.query.get("limit"), 100, 1, 500)
        offset = _int(request.query.get("cursor"), 0, 0, 10**9)
        page = jobs[offset:offset + limit]
        cursor = str(offset + limit) if offset + limit < len(jobs) else None
        return 200, [("Content-Type", "application/json")], _json({"data": [self._view(j, now) for j in page], "next_cursor": cursor})

    def _usage(self, request: Request):
        params: list[Any] = [request.channel]
        sql = "SELECT * FROM ledger WHERE channel = ?"
        if request.query.get("client_ref"):
            sql += " AND client_ref = ?"
            params.append(request.query["client_ref"])
        if request.query.get("since"):
            since = _parse_time(request.query["since"])
            if since is None:
                return _problem_tuple(400, "invalid_request", "since must be an RFC 3339 time.")
            sql += " AND created_at >= ?"
            params.append(since)
        cursor = _int(request.query.get("cursor"), 0, 0, 10**12)
        limit = _int(request.query.get("limit"), 100, 1, 1000)
        sql += " AND seq > ? ORDER BY seq LIMIT ?"
        params += [cursor, limit + 1]
        rows = self.store.query(sql, tuple(params))
        data = [
            {"entry_id": r["entry_id"], "job_id": r["job_id"], "client_ref": r["client_ref"],
             "idempotency_key": r["idempotency_key"], "units": r["units"], "unit": r["unit"],
             "amount_cents": r["amount_cents"], "created_at": J.rfc3339(r["created_at"])}
            for r in rows[:limit]
        ]
        next_cursor = str(rows[limit - 1]["seq"]) if len(rows) > limit else None
        return 200, [("Content-Type", "application/json")], _json({"data": data, "next_cursor": next_cursor})

    def _view(self, job: dict[str, Any], now: float) -> dict[str, Any]:
        if J.job_status(job, now) == "completed":
            self._ensure_result(job)
        return J.job_view(job, now)

    def _ensure_result(self, job: dict[str, Any]) -> Path:
        path = self.store.dir / "results" / job["id"]
        if not path.exists():
            data = J.generate_result(job["kind"], job["target_format"], job["input_sha256"])
            path.write_bytes(data)
        if not job.get("result_sha256"):
            data = path.read_bytes()
            job["result_sha256"] = hashlib.sha256(data).hexdigest()
            job["result_size"] = len(data)
            job["result_content_type"] = J.CONTENT_TYPES.get(job["target_format"], "application/octet-stream")
            self.store.update_job(job["id"], result_sha256=job["result_sha256"], result_size=job["result_size"],
                                  result_content_type=job["result_content_type"])
        return path

    def _result(self, request: Request):
        job = self._job_or_404(request)
        if isinstance(job, tuple):
            return job
        request.client_ref, request.input_sha256 = job["client_ref"], job["input_sha256"]
        now = time.time()
        status = J.job_status(job, now)
        if status != "completed":
            return _problem_tuple(409, "not_ready", f"The job is {status}.")
        channel = self.config.channel(request.channel)
        if now > job["end_at"] + channel.result_ttl_s * self.config.time_scale:
            return _problem_tuple(410, "result_expired", "The result is past its retention.")
        path = self._ensure_result(job)
        sha = job["result_sha256"]
        if job.get("digest_mismatch"):
            sha = J._flip(sha)
        self.store.update_job(job["id"], fetched_at=now)
        return 200, [("Content-Type", job["result_content_type"]), ("X-Content-SHA256", sha)], path

    def _cancel(self, request: Request, channel: ChannelConfig):
        job = self._job_or_404(request)
        if isinstance(job, tuple):
            return job
        request.client_ref, request.input_sha256 = job["client_ref"], job["input_sha256"]
        now = time.time()
        status = J.job_status(job, now)
        if status in ("completed", "failed", "canceled") or job.get("canceled_at") is not None:
            if status == "canceled" or job.get("canceled_at") is not None:
                return 202, [("Content-Type", "application/json")], _json(self._view(job, now))
            return _problem_tuple(409, "already_finished", f"The job is already {status}.")
        when = now + self.scaled(channel.cancel_delay_ms)
        if when < job["end_at"]:
            job["canceled_at"] = when
            self.store.update_job(job["id"], canceled_at=when)
        return 202, [("Content-Type", "application/json")], _json(self._view(job, now))

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
            status = J.job_status(job, now)
            if assemblyai._extra(job).get("dialect") == "assemblyai":
                body, headers = self.assemblyai.callback(job, now)
            else:
                event = {"event": f"job.{status}", "event_id": f"evt_{job['id']}_{status}", "job": self._view(job, now)}
                body = json.dumps(event).encode()
                secret = self.config.channel(job["channel"]).webhook_secret.encode()
                signature = hmac.new(secret, body, hashlib.sha256).hexdigest()
                headers = {"Content-Type": "application/json", "X-Vendor-Signature": f"sha256={signature}"}
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

    # --- control API ----------------------------------------------------------------------
    async def _admin(self, conn: Wire, request: Request) -> None:
        route, method = request.route[1:], request.method
        if route == ["health"]:
            await conn.respond(200, [("Content-Type", "application/json")], _json({"ok": True, "port": self.config.port}))
            return
        if request.headers.get("authorization", "") != f"Bearer {self.config.admin_token}":
            await self._discard_body(conn, request)
            await self._admin_answer(conn, _problem_tuple(401, "unauthenticated", "The admin token is required."))
            return
        body: Any = None
        if conn.body_pending:
            chunks: list[bytes] = []
            try:
                await conn.read_body(request, sink=chunks.append, limit=MAX_JSON_BODY)
            except OverflowError:
                await self._admin_answer(conn, _problem_tuple(413, "too_large", "Control bodies up to 1 MiB."))
                return
            raw = b"".join(chunks)
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    await self._admin_answer(conn, _problem_tuple(400, "invalid_json", "The body is not valid JSON.", field="body"))
                    return
        await self._admin_answer(conn, self._admin_route(route, method, request, body))

    async def _admin_answer(self, conn: Wire, answer: tuple) -> None:
        status, headers, body = answer
        await conn.respond(status, headers, body)

    def _admin_route(self, route: list[str], method: str, request: Request, body: Any) -> tuple:
        if route == ["faults"]:
            if method == "GET":
                return 200, [("Content-Type", "application/json")], _json({"data": [r.as_dict() for r in self.faults.rules], "seed": self.faults.seed})
            if method == "POST":
                try:
                    rule = self.faults.add(body)
                except RuleError as exc:
                    return _problem_tuple(400, "invalid_rule", exc.message, field=exc.field)
                return 201, [("Content-Type", "application/json")], _json(rule.as_dict())
            if method == "DELETE":
                count = len(self.faults.rules)
                self.faults.clear()
                return 200, [("Content-Type", "application/json")], _json({"deleted": count})
        if len(route) == 2 and route[0] == "faults" and method == "DELETE":
            if self.faults.remove(route[1]):
                return 200, [("Content-Type", "application/json")], _json({"deleted": 1})
            return _problem_tuple(404, "not_found", "No rule with this id.")
        if route == ["seed"] and method == "PUT":
            seed = body.get("seed") if isinstance(body, dict) else None
            if isinstance(seed, bool) or not isinstance(seed, int):
                return _problem_tuple(400, "invalid_seed", "seed must be an integer.", field="seed")
            self.faults.set_seed(seed)
            return 200, [("Content-Type", "application/json")], _json({"seed": seed})
        if route == ["reset"] and method == "POST":
            what = body if isinstance(body, dict) else {"faults": True, "state": True, "journal": True}
            if what.get("faults"):
                self.faults.clear()
            self.store.reset(state=bool(what.get("state")), journal=bool(what.get("journal")))
            if what.get("state"):
                self.uploads_max.clear()
                self.buckets.clear()
            return 200, [("Content-Type", "application/json")], _json({"reset": what})
        if route == ["amnesia"] and method == "POST":
            forgotten = self.store.forget()
            self.uploads_now.clear()
            return 200, [("Content-Type", "application/json")], _json({"forgotten": forgotten})
        if route == ["ledger"] and method == "GET":
            rows = self.store.ledger()
            data = [{**{k: r[k] for k in ("seq", "entry_id", "channel", "job_id", "client_ref", "idempotency_key",
                                          "units", "unit", "amount_cents", "input_sha256")},
                     "created_at": J.rfc3339(r["created_at"])}
                    for r in rows]
            return 200, [("Content-Type", "application/json")], _json({"data": data})
        if route == ["journal"] and method == "GET":
            return self._journal(request)
        if route == ["in-flight"] and method == "GET":
            return 200, [("Content-Type", "application/json")], _json({"data": self.requests_in_flight()})
        if route == ["scenarios"] and method == "GET":
            return 200, [("Content-Type", "application/json")], _json({"data": self.faults.scenarios()})
        if route == ["scenarios", "reset"] and method == "POST":
            self.faults.reset_scenarios()
            return 200, [("Content-Type", "application/json")], _json({"data": self.faults.scenarios()})
        if route == ["invariants"] and method == "GET":
            return 200, [("Content-Type", "application/json")], _json(self.invariants())
        if route == ["channels"] and method == "GET":
            return 200, [("Content-Type", "application/json")], _json({n: c.as_dict() for n, c in self.config.channels.items()})
        if len(route) == 2 and route[0] == "channels" and method in ("PUT", "GET"):
            channel = self.config.channel(route[1])
            if method == "PUT":
                if not isinstance(body, dict):
                    return _problem_tuple(400, "invalid_channel", "Send a JSON object of settings.", field="body")
                try:
                    channel.update(body)
                except (ValueError, TypeError) as exc:
                    return _problem_tuple(400, "invalid_channel", str(exc), field=str(exc).split(" ")[0])
            return 200, [("Content-Type", "application/json")], _json(channel.as_dict())
        return _problem_tuple(404, "not_found", "No such control endpoint.")

    def _journal(self, request: Request) -> tuple:
        since = _float(request.query.get("since"))
        after_seq = _int(request.query.get("after_seq"), 0, 0, 10**12)
        limit = _int(request.query.get("limit"), 1000, 1, 100000)
        sql, params = "SELECT * FROM journal WHERE seq > ?", [after_seq]
        if since is not None:
            sql += " AND at >= ?"
            params.append(since)
        sql += " ORDER BY seq LIMIT ?"
        params.append(limit)
        rows = self.store.query(sql, tuple(params))
        data = [
            {"seq": r["seq"], "at": J.rfc3339(r["at"]), "ts": r["at"], "method": r["method"], "path": r["path"],
             "channel": r["channel"], "endpoint": r["endpoint"], "rule_id": r["rule_id"], "draw": r["draw"],
             "bytes_in": r["bytes_in"], "status": r["status"], "outcome": r["outcome"], "client_ref": r["client_ref"],
             "idempotency_key": r["idempotency_key"], "job_id": r["job_id"], "retry_after": r["retry_after"],
             "duration_ms": r["duration_ms"], "protocol": r["protocol"], "input_sha256": r["input_sha256"]}
            for r in rows
        ]
        return 200, [("Content-Type", "application/json")], _json({"data": data})

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

    def invariants(self) -> dict[str, Any]:
        now = time.time()
        duplicates = []
        for row in self.store.query(
            "SELECT channel, client_ref, COUNT(*) AS n, SUM(amount_cents) AS cents, GROUP_CONCAT(job_id) AS jobs"
            " FROM ledger WHERE client_ref != '' GROUP BY channel, client_ref HAVING n > 1"
        ):
            duplicates.append({"channel": row["channel"], "client_ref": row["client_ref"], "jobs": row["jobs"].split(","),
                               "amount_cents": row["cents"]})
        jobs = [dict(r) for r in self.store.query("SELECT * FROM jobs")]
        never_fetched = [
            {"job_id": j["id"], "channel": j["channel"], "client_ref": j["client_ref"], "input_sha256": j["input_sha256"]}
            for j in jobs if J.job_status(j, now) == "completed" and not j.get("fetched_at")
        ]
        running = [j for j in jobs if J.job_status(j, now) in ("queued", "processing")]
        per_channel: dict[str, int] = {}
        overall = _max_overlap([(j["created_at"], J.job_end(j)) for j in jobs])
        for name in {j["channel"] for j in jobs}:
            per_channel[name] = _max_overlap([(j["created_at"], J.job_end(j)) for j in jobs if j["channel"] == name])
        by_endpoint = {
            r["endpoint"]: r["n"] for r in self.store.query("SELECT endpoint, COUNT(*) AS n FROM journal GROUP BY endpoint")
        }
        per_job: dict[str, dict[str, float]] = {}
        for r in self.store.query(
            "SELECT endpoint, COUNT(DISTINCT job_id) AS jobs, COUNT(*) AS total FROM journal"
            " WHERE job_id IS NOT NULL AND endpoint LIKE '% /v1/jobs/*%' GROUP BY endpoint"
        ):
            top = self.store.query(
                "SELECT COUNT(*) AS n FROM journal WHERE endpoint = ? AND job_id IS NOT NULL GROUP BY job_id ORDER BY n DESC LIMIT 1",
                (r["endpoint"],),
            )
            per_job[r["endpoint"]] = {"jobs": r["jobs"], "total": r["total"], "max": top[0]["n"] if top else 0,
                                      "mean": round(r["total"] / max(r["jobs"], 1), 2)}
        ledger = self.store.query("SELECT COUNT(*) AS n, COALESCE(SUM(amount_cents), 0) AS cents FROM ledger")[0]
        return {
            "duplicate_billed_client_refs": duplicates,
            "billed_never_fetched": never_fetched,
            "running_jobs": len(running),
            "max_concurrent_jobs": overall,
            "max_concurrent_jobs_by_channel": per_channel,
            "max_concurrent_uploads_by_channel": dict(self.uploads_max),
            "requests_by_endpoint": by_endpoint,
            "requests_per_job": per_job,
            "billed_jobs": ledger["n"],
            "requests_in_flight": len(self.requests_now),
            "billed_cents": ledger["cents"],
        }


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals], key=lambda p: (p[0], p[1]))
    best = current = 0
    for _, step in points:
        current += step
        best = max(best, current)
    return best


def _delay_ms(params: dict[str, Any], rng: Any) -> float:
    if "ms" in params:
        return float(params["ms"])
    if "lower_ms" in params:
        return rng.uniform(params["lower_ms"], params["upper_ms"])
    value = rng.lognormvariate(math.log(max(params["median_ms"], 1e-3)), params["sigma"])
    return min(value, params.get("max_ms") or value)


def _malformed_body(kind: str, good: bytes | Path) -> bytes:
    """A 2xx body a client cannot use: not JSON, cut short, without the fields, or mistyped."""
    if kind == "empty":
        return b""
    if kind == "truncated_json":
        text = good.read_bytes() if isinstance(good, Path) else good
        return text[: max(len(text) // 2, 1)]
    if kind == "missing_fields":
        return b'{"ok": true}'
    if kind == "wrong_types":
        return b'{"id": null, "status": 7, "upload_id": [], "data": "none", "client_ref": {}}'
    return b"<html><body>502 upstream sent an unexpected answer</body></html>"


def _json(data: Any) -> bytes:
    return json.dumps(data).encode()


def _json_field(body: bytes, name: str) -> str | None:
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _problem_tuple(status: int, code: str, detail: str, *, retryable: bool = False, extra: list | None = None,
                   field: str | None = None) -> tuple:
    payload = {"type": f"https://sluice.invalid/vendor/{code}", "title": _reason(status).decode() or code,
               "status": status, "code": code, "detail": detail, "retryable": retryable}
    if field:
        payload["field"] = field
    return status, [("Content-Type", "application/problem+json"), *(extra or [])], _json(payload)


def _int(value: str | None, default: int, low: int, high: int) -> int:
    try:
        return min(max(int(value), low), high) if value is not None else default
    except ValueError:
        return default


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _parse_time(value: str) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def run(config: ServerConfig, *, rules: list[dict[str, Any]] | None = None, ready_file: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM."""

    async def main() -> None:
        vendor = FakeVendor(config)
        for rule in rules or []:
            vendor.faults.add(rule)
        await vendor.start()
        print(f"fake vendor listening on http://{config.host}:{config.port}", flush=True)
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
