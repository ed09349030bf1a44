"""transient_404: reads of a new job answer 404 for a while (eventual consistency)."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class Transient404(Fault):
    name = "transient_404"
    family = "job"
    stages = ("job_lifecycle",)
    params = (Param("ms", required=True, example=3000, help="the new job answers 404 this long"),)
    examples = ({"ms": 2000},)
    summary = "reads of the new job answer 404 for a while"
    processed = True

    def on_job(self, job, params, scaled, now):
        job["not_found_until"] = now + scaled(params["ms"])


FAULT = Transient404()
