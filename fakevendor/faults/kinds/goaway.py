"""goaway: HTTP/2's GOAWAY refusing the request before it is processed."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class Goaway(Fault):
    name = "goaway"
    stages = ("connect",)
    params = (Param("last_stream_id", "integer"), Param("error_code", "integer"))
    examples = ({}, {"last_stream_id": 1, "error_code": 2})
    summary = ("HTTP/2: a real GOAWAY frame, the request **not processed** (default last-stream-id: below this "
               "stream, so a client may resend it; httpx does so by itself); streams at or below it still get "
               "their answers, streams above it are cut off, then the connection closes. HTTP/1.1: closed "
               "without an answer")
    processed = False

    async def before(self, ctx, decision):
        params = decision.params
        await ctx.conn.goaway(last_stream_id=params.get("last_stream_id"), error_code=int(params.get("error_code") or 0))
        return None, "goaway"


FAULT = Goaway()
