"""duplicate_on_create: the same vendor bug by its usual name (two jobs unless told)."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class DuplicateOnCreate(Fault):
    name = "duplicate_on_create"
    family = "create"
    stages = ("job_lifecycle",)
    params = (Param("copies", "integer", example=2, minimum=2),)
    examples = ({}, {"copies": 2})
    summary = "one request, two billed jobs (no resend needed, unlike `ignore_idempotency`)"
    processed = True

    def on_create(self, params):
        return {"copies": int(params.get("copies") or 2)}


FAULT = DuplicateOnCreate()
