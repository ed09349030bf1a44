"""HTTP/1.1 on one client connection (h11), with the socket-level fault primitives: a real TCP
reset (SO_LINGER 0), a close, random bytes, a stall, an answer cut off or written in slices."""

from __future__ import annotations

import asyncio
import math
import socket
import struct
from email.utils import formatdate
from pathlib import Path
from typing import Any

import h11

from fakevendor.errors import Aborted, ClientGone
from fakevendor.pacing import paced
from fakevendor.transport import reason as _reason

READ_SIZE = 64 * 1024


class Connection:
    """One client connection: h11 state plus the socket-level fault primitives."""

    protocol = "HTTP/1.1"

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
        request: Any,
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
                    if getattr(request, "body_cut", "reset") == "close":
                        self.close()  # limit_data upstream: closed, not reset on purpose
                        raise Aborted("closed mid-body")
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

    async def respond_malformed_chunk(self, status: int, headers: list[tuple[str, str]], garbage: bytes) -> None:
        """A chunked answer's status line and headers, then bytes that are no chunk, then the close."""
        self._write(h11.Response(status_code=status, reason=_reason(status), headers=[
            *headers, ("Transfer-Encoding", "chunked"), ("Date", formatdate(usegmt=True))]))
        # Not a hexadecimal size line: no HTTP parser can read a body out of this.
        self.writer.write(b"zz" + garbage.replace(b"\r\n", b"  ") + b"\r\n")
        await self.writer.drain()
        self.close()

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
