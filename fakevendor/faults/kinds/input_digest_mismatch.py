"""input_digest_mismatch: the job reports an input other than what was sent."""

from __future__ import annotations

from fakevendor.faults.base import Fault


class InputDigestMismatch(Fault):
    name = "input_digest_mismatch"
    family = "job"
    stages = ("job_lifecycle",)
    summary = "the job reports an `input.sha256` other than what was sent (the vendor processed another input)"
    processed = True

    def on_job(self, job, params, scaled, now):
        job["input_digest_mismatch"] = 1


FAULT = InputDigestMismatch()
