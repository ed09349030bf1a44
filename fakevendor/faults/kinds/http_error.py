"""http_error: an error answer instead of processing the request."""

from __future__ import annotations

import json

from fakevendor.faults.base import Fault, Param


class HttpError(Fault):
    name = "http_error"
    stages = ("response_headers",)
    params = (
        Param("status", "integer", True, 503, help="400-599", minimum=400, maximum=599),
        Param("code", "text", help="error code in the body"),
        Param("body", "json", help="the whole body instead (JSON)"),
    )
    examples = ({"status": 502, "code": "bad_gateway"}, {"status": 500, "body": {"message": "internal"}})
    summary = "that answer, not processed"
    processed = False

    async def before(self, ctx, decision):
        params = decision.params
        await ctx.discard_body()
        status = int(params["status"])
        body = params.get("body")
        if body is not None:
            payload = body if isinstance(body, str) else json.dumps(body)
            await ctx.respond(status, [("Content-Type", "application/json")], payload.encode())
        else:
            await ctx.problem(status, params.get("code") or f"http_{status}", "Injected error.", retryable=status >= 500)
        return status, "http_error"


FAULT = HttpError()
