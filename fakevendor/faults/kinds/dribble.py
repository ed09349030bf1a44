"""dribble: the answer in a few slow pieces."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class Dribble(Fault):
    name = "dribble"
    stages = ("response_body",)
    params = (
        Param("chunks", "integer", True, 5, help="the answer in this many pieces", minimum=1),
        Param("total_ms", required=True, example=3000, help="spread over this long"),
    )
    examples = ({"chunks": 10, "total_ms": 5000},)
    summary = "the answer in slow pieces"
    processed = True

    async def answer(self, ctx, decision, status, headers, body):
        params = decision.params
        await ctx.respond(status, headers, body, dribble=(int(params["chunks"]), ctx.scaled(params["total_ms"])))
        return status, "dribble"


FAULT = Dribble()
