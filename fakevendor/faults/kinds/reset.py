"""reset: a real TCP RST (SO_LINGER 0), before the body or after N of its bytes."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param, RuleError


class Reset(Fault):
    name = "reset"
    stages = ("request_headers", "request_body")
    params = (
        Param("stage", "choice", example="before_body", choices=("before_body", "mid_body")),
        Param("after_bytes", "integer", help="for mid_body: reset after this many bytes"),
    )
    examples = ({"stage": "before_body"}, {"stage": "mid_body", "after_bytes": 1048576})
    summary = "a real TCP RST: `ReadError`/`WriteError`; not processed"
    processed = False

    def check(self, params):
        if params.get("stage") == "mid_body" and params.get("after_bytes") is None:
            raise RuleError("params.after_bytes", "is required")

    async def before(self, ctx, decision):
        if decision.params.get("stage", "before_body") == "before_body":
            ctx.conn.reset()
            return None, "reset"
        return None

    def reading(self, decision, time_scale):
        if decision.params.get("stage") == "mid_body":
            return {"reset_after": int(decision.params["after_bytes"])}
        return {}


FAULT = Reset()
