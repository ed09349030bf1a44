"""delay: a latency before the vendor answers (fixed, uniform or log-normal)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fakevendor.faults.base import Fault, Param, RuleError


class Delay(Fault):
    name = "delay"
    stages = ("request_headers",)
    params = (
        Param("ms", example=2000, help="a fixed delay"),
        Param("lower_ms", help="with upper_ms: uniform between the two"),
        Param("upper_ms"),
        Param("median_ms", help="with sigma: log-normal around the median"),
        Param("sigma"),
        Param("max_ms", help="caps the log-normal draw"),
    )
    examples = ({"ms": 800}, {"lower_ms": 100, "upper_ms": 900}, {"median_ms": 200, "sigma": 0.8, "max_ms": 5000})
    summary = "a slow answer; stacks (`\"stack\": true`) before another wire fault"
    processed = True
    stackable = True

    def check(self, params: dict[str, Any]) -> None:
        if params.get("ms") is not None:
            return
        if params.get("lower_ms") is not None or params.get("upper_ms") is not None:
            for name in ("lower_ms", "upper_ms"):
                if params.get(name) is None:
                    raise RuleError(f"params.{name}", "is required")
            if params["upper_ms"] < params["lower_ms"]:
                raise RuleError("params.upper_ms", "must be at least lower_ms")
        elif params.get("median_ms") is not None:
            if params.get("sigma") is None:
                raise RuleError("params.sigma", "is required")
        else:
            raise RuleError("params", "delay needs ms, lower_ms+upper_ms, or median_ms+sigma")

    async def before(self, ctx, decision):
        await asyncio.sleep(ctx.scaled(delay_ms(decision.params, decision.rng)))
        return None


def delay_ms(params: dict[str, Any], rng: Any) -> float:
    if params.get("ms") is not None:
        return float(params["ms"])
    if params.get("lower_ms") is not None:
        return rng.uniform(params["lower_ms"], params["upper_ms"])
    value = rng.lognormvariate(math.log(max(params["median_ms"], 1e-3)), params["sigma"])
    return min(value, params.get("max_ms") or value)


FAULT = Delay()
