"""duplicate_create: one request creates (and bills) several jobs."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class DuplicateCreate(Fault):
    name = "duplicate_create"
    family = "create"
    stages = ("job_lifecycle",)
    params = (Param("copies", "integer", True, 2, help="jobs created (and billed) per request", minimum=2),)
    examples = ({"copies": 3},)
    summary = "one request creates and bills that many jobs"
    processed = True

    def on_create(self, params):
        return {"copies": int(params["copies"])}


FAULT = DuplicateCreate()
