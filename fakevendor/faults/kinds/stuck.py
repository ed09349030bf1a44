"""stuck: the job stays processing much longer."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class Stuck(Fault):
    name = "stuck"
    family = "job"
    stages = ("job_lifecycle",)
    params = (Param("ms", required=True, example=600000, help="the job stays processing this long"),)
    examples = ({"ms": 600000},)
    summary = "the job stays `processing` that much longer"
    processed = True

    def on_job(self, job, params, scaled, now):
        job["end_at"] += scaled(params["ms"])


FAULT = Stuck()
