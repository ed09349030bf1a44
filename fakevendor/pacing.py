"""Writing an answer no faster than a bandwidth allows (both transports)."""

from __future__ import annotations

import asyncio
from pathlib import Path

READ_SIZE = 64 * 1024


async def paced(body: bytes | Path, bytes_per_s: float):
    """The body in pieces, each after the time the bandwidth allows for it (bytes or a file)."""
    piece = max(1, min(READ_SIZE, int(bytes_per_s / 20)))
    if isinstance(body, Path):
        with open(body, "rb") as handle:
            while chunk := handle.read(piece):
                yield chunk
                await asyncio.sleep(len(chunk) / bytes_per_s)
        return
    for index in range(0, len(body), piece):
        yield body[index:index + piece]
        await asyncio.sleep(min(piece, len(body) - index) / bytes_per_s)
