"""stall: hold the request; for a while (then it is processed) or for ever (never answered)."""

from __future__ import annotations

import asyncio

from fakevendor.faults.base import Fault, Param


class Stall(Fault):
    name = "stall"
    stages = ("request_headers",)
    params = (Param("ms", example=30000, nullable=True, help="how long; empty or null: never answer"),)
    examples = ({"ms": None}, {"ms": 30000})
    summary = "`ReadTimeout` (or a very late answer); stacks (`\"stack\": true`) before another wire fault"
    processed = None
    stackable = True

    async def before(self, ctx, decision):
        ms = decision.params.get("ms")
        if ms is None:
            await ctx.conn.stall_forever()
            return None, "stall"
        await asyncio.sleep(ctx.scaled(ms))
        return None


FAULT = Stall()
