"""garbage: random bytes instead of HTTP, then the close."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class Garbage(Fault):
    name = "garbage"
    stages = ("response_headers",)
    params = (Param("bytes", "integer", example=64, help="random bytes instead of HTTP", minimum=1),)
    examples = ({"bytes": 64},)
    summary = "random bytes, then close: `RemoteProtocolError`; not processed"
    processed = False

    async def before(self, ctx, decision):
        await ctx.discard_body()
        await ctx.conn.garbage(int(decision.params.get("bytes") or 64), decision.rng)
        return None, "garbage"


FAULT = Garbage()
