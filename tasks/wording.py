"""What Sluice says to people: plain words for the codes the API and the logs keep.

One catalogue for the portal and the console. The API returns the codes (stable, for machines);
pages show these sentences, with the code beside them where operators need it.
"""

from __future__ import annotations

from tasks.states import WAITING_REASONS

QUARANTINE_REASONS: dict[str, str] = {
    "corrupt_file": "the file is damaged or incomplete",
    "type_mismatch": "the file's content does not match its name",
    "unsupported_type": "this type of file cannot be processed",
    "executable": "the file is a program, not audio or a document",
    "zip_bomb": "the document expands to far more data than it holds",
    "encrypted_document": "the document is password-protected",
    "over_limit": "the file is longer or larger than allowed",
    "precheck_crashed": "the file could not be checked safely",
    "precheck_timeout": "checking the file took too long",
    "poison": "tasks on this file keep failing at the vendor",
    "trailing_payload": "the file carries extra data after its end",
}

ERRORS: dict[str, str] = {
    "quarantined": "the file was held back by the safety check",
    "deadline_exceeded": "it could not be finished before its deadline",
    "queue_deadline_exceeded": "it waited too long to start",
    "shed": "the service was overloaded and could not take it",
    "execution_timeout": "a processing step took too long",
    "retries_exhausted": "the vendor kept failing; every retry was used",
    "poll_budget_exhausted": "the vendor did not finish in time",
    "transcription_error": "the vendor could not process the file",
    "input_mismatch": "the vendor received a different file than the one sent",
    "result_digest_mismatch": "the result arrived damaged",
    "result_expired": "the vendor deleted the result before it was downloaded",
    "vendor_lost_job": "the vendor lost the job",
    "job_not_found": "the vendor lost the job",
    "malformed_response": "the vendor answered something that could not be understood",
    "step_crashed": "an internal error stopped the work",
    "worker_stopped": "the worker stopped while processing",
    "lease_expired": "the worker processing it stopped answering",
    "unsupported_mode": "the vendor cannot do this kind of work",
    "cancelled": "it was cancelled",
    "engine_timeout": "converting the document took longer than allowed",
    "engine_cpu_exceeded": "converting the document took more computing time than allowed",
    "engine_out_of_memory": "converting the document needed more memory than allowed",
    "engine_crashed": "the converter crashed on this document",
    "output_too_large": "the converted document was larger than allowed",
    "unsupported_conversion": "this document cannot be converted to the format asked for",
    "engine_input_invalid": "the document is not what its name says",
    "engine_not_installed": "the conversion engine is not installed here",
}


def waiting_words(code: str | None) -> str:
    if not code:
        return ""
    return WAITING_REASONS.get(code, code.replace("_", " "))


def quarantine_words(code: str | None) -> str:
    if not code:
        return ""
    return QUARANTINE_REASONS.get(code, code.replace("_", " "))


def error_words(code: str | None, *, findings: dict | None = None) -> str:
    """A failure in a sentence; for a quarantined file, what the pre-check found in it."""
    if not code:
        return ""
    if code == "quarantined" and findings:
        notes = [n for n in findings.get("notes") or [] if n]
        reason = quarantine_words(findings.get("reason"))
        detail = notes[0] if notes else reason
        return f"the file was held back by the safety check: {detail}" if detail else ERRORS[code]
    if code.startswith("http_"):
        return f"the vendor answered an error ({code[5:]})"
    return ERRORS.get(code, code.replace("_", " "))

