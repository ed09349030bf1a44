"""The one small interface both transports (http1.Connection, http2.H2Stream) give the handlers.

A handler reads the request body and sends one answer through it; faults use its primitives
(a real reset, a close, a stall, GOAWAY). `respond_truncated` and `respond_sliced` write raw
HTTP/1.1 bytes and exist only there (the faults that need them declare `protocols`).
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


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
