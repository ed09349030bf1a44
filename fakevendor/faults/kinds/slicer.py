"""slicer: Toxiproxy's slicer: the whole answer in small pieces, each after a delay."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class Slicer(Fault):
    name = "slicer"
    stages = ("response_headers", "response_body")
    params = (
        Param("average_size", "integer", example=16, minimum=1, help="bytes per piece"),
        Param("size_variation", "integer", example=4, help="pieces vary by up to this many bytes"),
        Param("delay_ms", example=50, help="between pieces"),
    )
    examples = ({"average_size": 16, "size_variation": 4, "delay_ms": 50},)
    summary = ("the whole answer, status line and headers included, in small pieces each after a delay: a "
               "client whose timeouts are per read never times out while the pieces keep coming. HTTP/1.1")
    processed = True
    protocols = ("HTTP/1.1",)

    async def answer(self, ctx, decision, status, headers, body):
        params = decision.params
        await ctx.conn.respond_sliced(status, ctx.headers(headers), body, size=int(params.get("average_size") or 1),
                                      variation=int(params.get("size_variation") or 0),
                                      delay_s=ctx.scaled(params.get("delay_ms", 1000)), rng=decision.rng)
        return status, "slicer"


FAULT = Slicer()
