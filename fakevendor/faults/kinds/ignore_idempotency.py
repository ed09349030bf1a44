"""ignore_idempotency: the vendor disregards Idempotency-Key."""

from __future__ import annotations

from fakevendor.faults.base import Fault


class IgnoreIdempotency(Fault):
    name = "ignore_idempotency"
    family = "create"
    stages = ("job_lifecycle",)
    summary = "a repeat with the same key creates and bills another job"
    processed = True

    def on_create(self, params):
        return {"ignore_keys": True}


FAULT = IgnoreIdempotency()
