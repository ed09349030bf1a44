"""rate_limit: 429 or 503 with Retry-After, in seconds or as an HTTP date."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class RateLimit(Fault):
    name = "rate_limit"
    stages = ("response_headers",)
    params = (
        Param("status", "choice", example=429, choices=(429, 503)),
        Param("retry_after_s", example=5, help="Retry-After seconds"),
        Param("retry_after_date", "bool", help="send Retry-After as an HTTP date"),
    )
    examples = ({"retry_after_s": 7}, {"retry_after_s": 7, "retry_after_date": True, "status": 503})
    summary = "429/503 with `Retry-After` in seconds or as an HTTP-date; not processed"
    processed = False

    async def before(self, ctx, decision):
        params = decision.params
        await ctx.discard_body()
        status = int(params.get("status") or 429)
        await ctx.rate_limit_answer(retry_after_s=params.get("retry_after_s", 1), status=status,
                                    as_date=bool(params.get("retry_after_date")))
        return status, "rate_limited"


FAULT = RateLimit()
