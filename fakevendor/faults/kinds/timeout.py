"""timeout: Toxiproxy's timeout: nothing passes, then the connection closes."""

from __future__ import annotations

import asyncio

from fakevendor.faults.base import Fault, Param


class Timeout(Fault):
    name = "timeout"
    stages = ("request_headers",)
    params = (Param("ms", example=5000, help="pass no data, then close (empty: hold until the client gives up)"),)
    examples = ({"ms": 5000}, {})
    summary = ("Toxiproxy's timeout: nothing passes, the request is **not processed**, then the connection closes "
               "(`RemoteProtocolError` after `ms`; without `ms` it holds until the client's `ReadTimeout`)")
    processed = False

    async def before(self, ctx, decision):
        ms = decision.params.get("ms")
        if not ms:
            await ctx.conn.stall_forever()
            return None, "timeout"
        await asyncio.sleep(ctx.scaled(ms))
        ctx.conn.close()
        return None, "timeout"


FAULT = Timeout()
