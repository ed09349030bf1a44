"""The one small interface both transports (http1.Connection, http2.H2Stream) give the handlers.

A handler reads the request body and sends one answer through it; faults use its primitives
(a real reset, a close, a stall, GOAWAY, an answer cut short or with a broken body). `respond_sliced`
writes raw HTTP/1.1 bytes and exists only there (the faults that need it declare `protocols`).
"""

from __future__ import annotations

from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol


class Wire(Protocol):
    protocol: str  # "HTTP/1.1" or "HTTP/2"
    closed: bool

    @property
    def body_pending(self) -> bool: ...

    async def read_body(self, request: Any, *, sink: Any = None, bytes_per_s: float | None = None,
                        reset_after: int | None = None, limit: int | None = None) -> int: ...

    async def respond(self, status: int, headers: list[tuple[str, str]], body: bytes | Path = b"", *,
                      dribble: tuple[int, float] | None = None, close: bool = False,
                      bytes_per_s: float | None = None) -> None: ...

    def reset(self) -> None: ...
    def close(self) -> None: ...
    async def garbage(self, size: int, rng: Any) -> None: ...
    async def stall_forever(self) -> None: ...
    async def goaway(self, *, last_stream_id: int | None = None, error_code: int = 0) -> Any: ...
    async def respond_truncated(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, *,
                                limit: int) -> None: ...
    async def respond_malformed_chunk(self, status: int, headers: list[tuple[str, str]], garbage: bytes) -> None: ...


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
