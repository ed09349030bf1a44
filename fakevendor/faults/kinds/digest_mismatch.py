"""digest_mismatch: the result's declared sha256 is not its bytes'."""

from __future__ import annotations

from fakevendor.faults.base import Fault


class DigestMismatch(Fault):
    name = "digest_mismatch"
    family = "job"
    stages = ("job_lifecycle",)
    summary = "the result's declared sha256 does not match its bytes"
    processed = True

    def on_job(self, job, params, scaled, now):
        job["digest_mismatch"] = 1


FAULT = DigestMismatch()
