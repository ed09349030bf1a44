"""job_fail: the job ends failed, with a code and whether a retry may help."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class JobFail(Fault):
    name = "job_fail"
    family = "job"
    stages = ("job_lifecycle",)
    params = (Param("code", "text", example="transcription_error"), Param("retryable", "bool"))
    examples = ({"code": "bad_audio", "retryable": False},)
    summary = "the job ends `failed`"
    processed = True

    def on_job(self, job, params, scaled, now):
        job["fail_code"] = params.get("code") or "processing_failed"
        job["fail_retryable"] = int(bool(params.get("retryable", False)))


FAULT = JobFail()
