"""reset_peer: Toxiproxy's reset_peer: a TCP RST after a delay, nothing processed."""

from __future__ import annotations

import asyncio

from fakevendor.faults.base import Fault, Param


class ResetPeer(Fault):
    name = "reset_peer"
    stages = ("connect",)
    params = (Param("ms", required=True, example=1000, help="wait this long, then reset the connection (TCP RST)"),)
    examples = ({"ms": 1000},)
    summary = "the request **not processed**; after `ms` a real TCP RST (`ReadError`)"
    processed = False

    async def before(self, ctx, decision):
        await asyncio.sleep(ctx.scaled(decision.params["ms"]))
        ctx.conn.reset()
        return None, "reset_peer"


FAULT = ResetPeer()
