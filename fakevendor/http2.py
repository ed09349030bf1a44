"""HTTP/2 with prior knowledge (h2c): the same vendor API, multiplexed, plus a real GOAWAY.

A connection whose first bytes are the HTTP/2 preface is served here instead of by h11. Each
stream is handled as its own asyncio task; an `H2Stream` offers the handlers the same surface as
the HTTP/1.1 `Connection` in server.py (read_body, respond, reset, close, garbage, stall_forever,
goaway), so every fault rule works on both protocols:

- reset / close / garbage act on the whole TCP connection (every stream on it is lost), as a
  crashing or misbehaving front end would;
- stall holds one stream unanswered while the others go on;
- goaway sends a GOAWAY frame with the chosen last-stream-id and error code, lets the streams at
  or below it finish, cuts the ones above it off and then closes the connection. A client may
  safely resend a request whose stream id is above last-stream-id (httpx does it by itself); one
  at or below it may have been processed and needs reconciling.
"""

from __future__ import annotations

import asyncio
import math
import socket
import struct
from email.utils import formatdate
from pathlib import Path
from typing import Any, Awaitable, Callable

from h2 import events
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import H2Error
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

from fakevendor.errors import Aborted, ClientGone
from fakevendor.pacing import paced

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
READ_SIZE = 64 * 1024
# The most bytes the client may have in flight per stream: what bandwidth limits act on.
STREAM_WINDOW = 256 * 1024

_END = object()


class H2Stream:
    """One request/response exchange on an HTTP/2 connection."""

    protocol = "HTTP/2"
    stream_id: int

    def __init__(self, session: H2Session, stream_id: int) -> None:
        self.session = session
        self.stream_id = stream_id
        self.chunks: asyncio.Queue[Any] = asyncio.Queue()
        self.body_pending = True
        self.answered = False
        self.task: asyncio.Task | None = None

    @property
    def closed(self) -> bool:
        return self.session.closed

    # --- the surface the handlers use ------------------------------------------------------
    async def read_body(
        self,
        request: Any,
        *,
        sink: Callable[[bytes], None] | None = None,
        bytes_per_s: float | None = None,
        reset_after: int | None = None,
        limit: int | None = None,
    ) -> int:
        total = 0
        while True:
            item = await self.chunks.get()
            if item is _END:
                self.body_pending = False
                request.bytes_in = total
                return total
            if item is None:
                request.bytes_in = total
                raise ClientGone()
            chunk, flow = item
            if bytes_per_s:
                await asyncio.sleep(len(chunk) / bytes_per_s)
            if reset_after is not None and total + len(chunk) >= reset_after:
                request.bytes_in = reset_after
                if getattr(request, "body_cut", "reset") == "close":
                    self.close()  # a FIN, not a reset (limit_data upstream)
                    raise Aborted("closed mid-body")
                self.reset()
                raise Aborted("reset mid-body")
            total += len(chunk)
            # Credit the client only for what we consumed: that is the backpressure.
            self.session.acknowledge(self.stream_id, flow)
            if limit is not None and total > limit:
                request.bytes_in = total
                raise OverflowError()
            if sink is not None:
                sink(chunk)

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
        all_headers = [
            (":status", str(status)),
            *[(name.lower(), value) for name, value in headers if name.lower() != "connection"],
            ("content-length", str(size)),
            ("date", formatdate(usegmt=True)),
        ]
        self.answered = True
        await self.session.send_headers(self.stream_id, all_headers, end_stream=size == 0)
        if not size:
            return
        if bytes_per_s:
            sent = 0
            async for piece in paced(body, bytes_per_s):
                sent += len(piece)
                await self.session.send_data(self.stream_id, piece, end_stream=sent >= size)
            return
        if isinstance(body, Path):
            with open(body, "rb") as handle:
                while chunk := handle.read(READ_SIZE):
                    last = handle.tell() >= size
                    await self.session.send_data(self.stream_id, chunk, end_stream=last)
            return
        if dribble:
            chunks, total_s = dribble
            step = math.ceil(len(body) / chunks)
            for index in range(0, len(body), step):
                last = index + step >= len(body)
                await self.session.send_data(self.stream_id, body[index:index + step], end_stream=last)
                if not last:
                    await asyncio.sleep(total_s / chunks)
            return
        await self.session.send_data(self.stream_id, body, end_stream=True)

    async def respond_truncated(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, *,
                                limit: int) -> None:
        """The answer's headers and the first `limit` bytes of its body, then the connection closes
        (Toxiproxy's limit_data; HPACK-compressed headers are not counted)."""
        payload = body.read_bytes() if isinstance(body, Path) else body
        self.answered = True
        await self.session.send_headers(self.stream_id, [
            (":status", str(status)), *[(k.lower(), v) for k, v in headers if k.lower() != "connection"],
            ("content-length", str(len(payload))), ("date", formatdate(usegmt=True))], end_stream=False)
        if limit > 0 and payload:
            await self.session.send_data(self.stream_id, payload[:limit], end_stream=False)
        await self.session.flush()
        self.session.close()

    async def respond_malformed_chunk(self, status: int, headers: list[tuple[str, str]], garbage: bytes) -> None:
        """The headers, a DATA frame of random bytes shorter than announced, then the close."""
        self.answered = True
        await self.session.send_headers(self.stream_id, [
            (":status", str(status)), *[(k.lower(), v) for k, v in headers if k.lower() != "connection"],
            ("content-length", str(len(garbage) * 4)), ("date", formatdate(usegmt=True))], end_stream=False)
        await self.session.send_data(self.stream_id, garbage, end_stream=False)
        await self.session.flush()
        self.session.close()

    def reset(self) -> None:
        self.session.abort()

    def close(self) -> None:
        self.session.close()

    async def garbage(self, size: int, rng: Any) -> None:
        self.session.writer.write(bytes(rng.getrandbits(8) for _ in range(size)))
        await self.session.writer.drain()
        self.session.close()

    async def stall_forever(self) -> None:
        """Never answer this stream; the others on the connection go on."""
        await self.session.gone.wait()

    async def goaway(self, *, last_stream_id: int | None = None, error_code: int = 0) -> int:
        """Send GOAWAY (default last-stream-id: below this stream, i.e. "not processed")."""
        if last_stream_id is None:
            last_stream_id = max(self.stream_id - 2, 0)
        await self.session.goaway(last_stream_id, error_code, origin=self)
        return last_stream_id


class H2Session:
    """An HTTP/2 server connection: reads frames, runs a task per stream, enforces flow control."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        serve_stream: Callable[[H2Stream, list[tuple[str, str]]], Awaitable[None]],
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.serve_stream = serve_stream
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        self.streams: dict[int, H2Stream] = {}
        self.closed = False
        self.gone = asyncio.Event()
        self.window = asyncio.Event()
        self.draining_above: int | None = None

    async def run(self, preface: bytes) -> None:
        self.h2.initiate_connection()
        self.h2.update_settings({
            SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
        })
        self.h2.increment_flow_control_window(64 * 1024 * 1024)
        await self.flush()
        data = preface
        try:
            while not self.closed:
                if data:
                    try:
                        received = self.h2.receive_data(data)
                    except H2Error:
                        # A protocol violation (e.g. a body longer or shorter than its
                        # content-length): h2 has queued a GOAWAY with the error; send it, close.
                        await self.flush()
                        break
                    for event in received:
                        self._dispatch(event)
                    await self.flush()
                data = await self.reader.read(READ_SIZE)
                if not data:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.close()
            for stream in list(self.streams.values()):
                if stream.task is not None and not stream.task.done():
                    stream.task.cancel()

    def _dispatch(self, event: Any) -> None:
        if isinstance(event, events.RequestReceived):
            if self.draining_above is not None and event.stream_id > self.draining_above:
                # Opened after our GOAWAY: never processed (the client may resend it elsewhere).
                self._stream_reset(event.stream_id, ErrorCodes.REFUSED_STREAM)
                return
            stream = H2Stream(self, event.stream_id)
            self.streams[event.stream_id] = stream
            stream.task = asyncio.get_running_loop().create_task(self._run_stream(stream, list(event.headers)))
        elif isinstance(event, events.DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.chunks.put_nowait((event.data, event.flow_controlled_length))
            else:
                self.acknowledge(event.stream_id, event.flow_controlled_length)
        elif isinstance(event, events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.chunks.put_nowait(_END)
        elif isinstance(event, events.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.chunks.put_nowait(None)
        elif isinstance(event, (events.WindowUpdated, events.RemoteSettingsChanged)):
            self._wake_senders()
        elif isinstance(event, events.ConnectionTerminated):
            self.close()

    async def _run_stream(self, stream: H2Stream, headers: list[tuple[str, str]]) -> None:
        try:
            await self.serve_stream(stream, headers)
            if stream.body_pending and not self.closed:
                # Answered without reading the body: tell the client to stop sending it.
                self._stream_reset(stream.stream_id, ErrorCodes.NO_ERROR)
        finally:
            self.streams.pop(stream.stream_id, None)
            while not stream.chunks.empty():
                item = stream.chunks.get_nowait()
                if isinstance(item, tuple) and not self.closed:
                    self.acknowledge(stream.stream_id, item[1])
            if not self.closed:
                await self.flush()
            self._close_if_drained()

    # --- writing -------------------------------------------------------------------------
    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.closed:
            self.writer.write(data)
            await self.writer.drain()

    def acknowledge(self, stream_id: int, size: int) -> None:
        if size and not self.closed:
            try:
                self.h2.acknowledge_received_data(size, stream_id)
            except H2Error:
                pass
            data = self.h2.data_to_send()
            if data:
                self.writer.write(data)

    async def send_headers(self, stream_id: int, headers: list[tuple[str, str]], *, end_stream: bool) -> None:
        self._guard()
        try:
            self.h2.send_headers(stream_id, headers, end_stream=end_stream)
        except H2Error:
            raise ClientGone() from None
        await self.flush()

    async def send_data(self, stream_id: int, data: bytes, *, end_stream: bool) -> None:
        view = memoryview(data)
        while True:
            self._guard()
            try:
                window = self.h2.local_flow_control_window(stream_id)
            except H2Error:
                raise ClientGone() from None
            size = min(window, self.h2.max_outbound_frame_size, len(view))
            if size <= 0 and len(view):
                await self._window_opens()
                continue
            last = size == len(view)
            try:
                self.h2.send_data(stream_id, bytes(view[:size]), end_stream=end_stream and last)
            except H2Error:
                raise ClientGone() from None
            view = view[size:]
            await self.flush()
            if last:
                return

    async def _window_opens(self) -> None:
        waiter = self.window
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(waiter.wait()), asyncio.ensure_future(self.gone.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        for future in done:
            future.result()

    def _wake_senders(self) -> None:
        self.window.set()
        self.window = asyncio.Event()

    def _guard(self) -> None:
        if self.closed:
            raise ClientGone()

    def _stream_reset(self, stream_id: int, code: ErrorCodes) -> None:
        try:
            self.h2.reset_stream(stream_id, error_code=code)
        except H2Error:
            pass

    # --- ending --------------------------------------------------------------------------
    async def goaway(self, last_stream_id: int, error_code: int, *, origin: H2Stream) -> None:
        """GOAWAY: streams above last_stream_id are cut off now, the others may finish.

        The frame is written by hand: h2's state machine allows no frame after its own GOAWAY,
        which would make the graceful part (answering the streams at or below it) impossible.
        """
        await self.flush()
        frame = GoAwayFrame(stream_id=0)
        frame.last_stream_id = last_stream_id
        frame.error_code = error_code
        self.writer.write(frame.serialize())
        await self.writer.drain()
        self.draining_above = last_stream_id
        for stream in list(self.streams.values()):
            if stream is not origin and stream.stream_id > last_stream_id and stream.task is not None:
                stream.task.cancel()
        self._close_if_drained(ignore=origin)

    def _close_if_drained(self, ignore: H2Stream | None = None) -> None:
        if self.draining_above is None or self.closed:
            return
        if not any(s is not ignore and s.stream_id <= self.draining_above for s in self.streams.values()):
            self.close()

    def abort(self) -> None:
        """A real TCP reset: SO_LINGER with a zero timeout, then close."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.writer.transport.abort()
        self._ended()

    def close(self) -> None:
        if not self.closed:
            self.writer.close()
        self._ended()

    def _ended(self) -> None:
        self.closed = True
        self.gone.set()
        self.window.set()
        for stream in self.streams.values():
            stream.chunks.put_nowait(None)
