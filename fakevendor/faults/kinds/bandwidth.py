"""bandwidth: the request body read and/or the answer written no faster than a rate."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param

DIRECTIONS = ("both", "upstream", "downstream")


class Bandwidth(Fault):
    name = "bandwidth"
    stages = ("request_body", "response_body")
    params = (
        Param("bytes_per_s", required=True, example=100000, minimum=1),
        Param("direction", "choice", example="both", choices=DIRECTIONS,
              help="upstream: the request body; downstream: the answer"),
    )
    examples = ({"bytes_per_s": 200000, "direction": "both"},)
    summary = ("the request body read and the answer written no faster than this (`direction`: `upstream` the "
               "request only, `downstream` the answer only): a slow upload (`WriteTimeout`, or a size-derived "
               "timeout that copes) or a slow result download")
    processed = True

    def _rate(self, decision, time_scale: float, side: str) -> float | None:
        if decision.params.get("direction", "both") not in ("both", side):
            return None
        return decision.params["bytes_per_s"] / time_scale

    def reading(self, decision, time_scale):
        rate = self._rate(decision, time_scale, "upstream")
        return {"bytes_per_s": rate} if rate else {}

    async def answer(self, ctx, decision, status, headers, body):
        rate = self._rate(decision, ctx.time_scale, "downstream")
        if rate is None:
            return None
        await ctx.respond(status, headers, body, bytes_per_s=rate)
        return status, "bandwidth"


FAULT = Bandwidth()
