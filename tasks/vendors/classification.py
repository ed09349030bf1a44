"""The one classification table for vendor call failures, as data.

Each row says what a failure proves about the request (shared/notes/resilience.md):
- NOT_PROCESSED: provably not processed → retry with the same key (after Retry-After).
- AMBIGUOUS: may have been processed → reconcile before anything else (for reads: retry).
- REFUSED: processed and refused → fail with an actionable message, no retry.
- ALARM: the vendor says our key was used for another request → fail and raise an alarm.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"
    NOT_PROCESSED = "not_processed"
    AMBIGUOUS = "ambiguous"
    REFUSED = "refused"
    ALARM = "alarm"


@dataclass(frozen=True)
class Row:
    outcome: Outcome
    # Does this failure count against the channel's circuit breaker? Refusals never do.
    breaker_failure: bool
    message: str
    exception: str | None = None
    status: int | None = None
    code: str | None = None
    # Flow control (rate limits, a key still in flight, an open breaker) is waited out: it does not
    # spend the channel's attempts or retry budget; the business deadline bounds it.
    flow_control: bool = False
    # The channel cannot take work at all (unreachable, unavailable, rate limiting, breaker open):
    # when every channel says so, the task waits for one to recover instead of failing.
    unavailable: bool = False


@dataclass(frozen=True)
class Failure:
    """A failure as the retry decision sees it: what it proves and how to wait, no exception, no HTTP.

    Vendor calls produce one from their classified error (`VendorError.failure`); the steps make
    one directly for what is not a call (a failed vendor job, a result that fails its digest, a
    reconciliation that found nothing, an execution timeout)."""

    outcome: Outcome
    code: str
    message: str
    error_class: str = ""
    retry_after_s: float | None = None
    # Rate limits, a key in flight, an open breaker: waited out, never counted as an attempt.
    flow_control: bool = False
    timeout: bool = False
    breaker_open: bool = False
    # The channel could not take the work at all (see Row.unavailable).
    unavailable: bool = False


NP, AMB, REF, ALARM = Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS, Outcome.REFUSED, Outcome.ALARM

TABLE: tuple[Row, ...] = (
    # Transport failures before any byte reached the vendor.
    Row(NP, True, "could not connect to the vendor", exception="ConnectError", unavailable=True),
    Row(NP, True, "connecting to the vendor timed out", exception="ConnectTimeout", unavailable=True),
    Row(NP, True, "no free connection in the client pool", exception="PoolTimeout"),
    Row(NP, True, "the vendor refused the HTTP/2 stream", exception="RefusedStream", unavailable=True),
    Row(NP, False, "the channel's circuit breaker is open", exception="BreakerOpen", flow_control=True, unavailable=True),
    # Answers that prove the request was not processed.
    Row(NP, False, "a request with this key is still in flight at the vendor", status=409, code="idempotency_key_in_use",
        flow_control=True),
    Row(NP, False, "the vendor's stored upload expired; upload again", status=404, code="upload_not_found"),
    Row(NP, False, "the vendor is rate limiting us", status=429, flow_control=True, unavailable=True),
    Row(NP, True, "the vendor is unavailable", status=503, unavailable=True),
    # Failures after the body was (partly) sent: the vendor may have acted on it.
    Row(AMB, True, "no answer from the vendor in time", exception="ReadTimeout"),
    Row(AMB, True, "the connection broke while reading the answer", exception="ReadError"),
    Row(AMB, True, "the vendor closed the connection without a valid answer", exception="RemoteProtocolError"),
    Row(AMB, True, "the connection broke while sending the body", exception="WriteError"),
    Row(AMB, True, "sending the body stalled", exception="WriteTimeout"),
    Row(AMB, True, "the upload exceeded its wall-clock deadline", exception="UploadDeadlineExceeded"),
    Row(AMB, True, "the download exceeded its wall-clock deadline", exception="DownloadDeadlineExceeded"),
    # A success nobody can read: a create may have happened (reconcile), a read is simply retried.
    Row(AMB, True, "the vendor answered success with a body Sluice cannot read", exception="MalformedResponse"),
    Row(AMB, True, "the vendor's gateway failed", status=502),
    Row(AMB, True, "the vendor's gateway timed out", status=504),
    Row(AMB, True, "the vendor failed internally", status=500),
    # The vendor saw our key with a different request: our bug or the vendor's.
    Row(ALARM, False, "the vendor saw this idempotency key with a different request", status=422, code="idempotency_key_mismatch"),
    # Redirects are never followed (an outbound URL is pinned to what was configured): refused,
    # and the operator is shown where the vendor pointed.
    *(Row(REF, False, "the vendor answered with a redirect, which Sluice never follows; check the channel's base URL",
          status=status, code=None) for status in (301, 302, 303, 307, 308)),
    # Processed and refused: retrying cannot help.
    Row(REF, False, "the vendor rejected the request as invalid; check kind, target format and options", status=400),
    Row(REF, False, "the vendor rejected our API key; fix the channel's api_key", status=401),
    Row(REF, False, "the vendor forbids this request for our account", status=403),
    Row(REF, False, "the vendor does not know this job", status=404),
    Row(REF, False, "the vendor's result expired before we fetched it", status=410),
    Row(REF, False, "the file is larger than the vendor accepts", status=413),
    Row(REF, False, "the vendor does not support this format", status=415),
    Row(REF, False, "the vendor could not process the request", status=422),
)

_BY_STATUS_CODE = {(r.status, r.code): r for r in TABLE if r.status is not None and r.code is not None}
_BY_STATUS = {r.status: r for r in TABLE if r.status is not None and r.code is None}
_BY_EXCEPTION = {r.exception: r for r in TABLE if r.exception is not None}

_UNKNOWN_SERVER_ERROR = Row(AMB, True, "the vendor answered with an unexpected server error")
_UNKNOWN_REDIRECT = Row(REF, False, "the vendor answered with an unexpected 3xx, which Sluice never follows")
_UNKNOWN_CLIENT_ERROR = Row(REF, False, "the vendor refused the request")
_UNKNOWN_EXCEPTION = Row(AMB, True, "an unexpected transport failure")


def classify_status(status: int, code: str | None = None) -> Row:
    """The row for an HTTP answer with this status and problem code."""
    if (status, code) in _BY_STATUS_CODE:
        return _BY_STATUS_CODE[(status, code)]
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if 300 <= status < 400:
        return _UNKNOWN_REDIRECT
    return _UNKNOWN_SERVER_ERROR if status >= 500 else _UNKNOWN_CLIENT_ERROR


def classify_exception(exc: BaseException | str) -> Row:
    """The row for a transport exception (by class name, walking up its base classes)."""
    if isinstance(exc, str):
        return _BY_EXCEPTION.get(exc, _UNKNOWN_EXCEPTION)
    for klass in type(exc).__mro__:
        if klass.__name__ in _BY_EXCEPTION:
            return _BY_EXCEPTION[klass.__name__]
    return _UNKNOWN_EXCEPTION
