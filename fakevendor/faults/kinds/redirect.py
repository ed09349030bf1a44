"""redirect: a 3xx pointing elsewhere instead of processing (a vendor, or a proxy in front of it)."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param

STATUSES = (301, 302, 303, 307, 308)


class Redirect(Fault):
    name = "redirect"
    stages = ("response_headers",)
    params = (Param("status", "choice", example=302, choices=STATUSES), Param("location", "text"))
    examples = ({"status": 307, "location": "http://elsewhere/"},)
    summary = "a 3xx with `Location`, the request **not processed** (a client must not follow it)"
    processed = False

    async def before(self, ctx, decision):
        await ctx.discard_body()
        status = int(decision.params.get("status") or 302)
        location = decision.params.get("location") or f"http://127.0.0.1:1{ctx.request.path}"
        await ctx.respond(status, [("Location", location)], b"")
        return status, "redirect"


FAULT = Redirect()
