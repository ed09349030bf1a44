"""slow_close: Toxiproxy's slow_close: the whole answer, then the connection lingers before closing."""

from __future__ import annotations

import asyncio

from fakevendor.faults.base import Fault, Param


class SlowClose(Fault):
    name = "slow_close"
    stages = ("response_body",)
    params = (Param("ms", required=True, example=3000, help="after the answer, keep the connection open this long, then close"),)
    examples = ({"ms": 3000},)
    summary = ("the whole answer (with `Connection: close`), then the server keeps the connection open `ms` before "
               "closing it: a client reading to the end of the stream waits. HTTP/1.1")
    processed = True
    protocols = ("HTTP/1.1",)

    async def answer(self, ctx, decision, status, headers, body):
        await ctx.respond(status, headers, body, close=True)
        await asyncio.sleep(ctx.scaled(decision.params["ms"]))
        ctx.conn.close()
        return status, "slow_close"


FAULT = SlowClose()
