"""One test per row of the vendor failure classification table."""

import httpx
import pytest

from tasks.vendors.classification import TABLE, Outcome, classify_exception, classify_status
from tasks.vendors.errors import DownloadDeadlineExceeded, MalformedResponse, UploadDeadlineExceeded

NP, AMB, REF, ALARM = Outcome.NOT_PROCESSED, Outcome.AMBIGUOUS, Outcome.REFUSED, Outcome.ALARM

EXCEPTIONS = [
    (httpx.ConnectError("x"), NP),
    (httpx.ConnectTimeout("x"), NP),
    (httpx.PoolTimeout("x"), NP),
    ("RefusedStream", NP),
    ("BreakerOpen", NP),
    (httpx.ReadTimeout("x"), AMB),
    (httpx.ReadError("x"), AMB),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), AMB),
    (httpx.WriteError("x"), AMB),
    (httpx.WriteTimeout("x"), AMB),
    (UploadDeadlineExceeded(), AMB),
    (DownloadDeadlineExceeded(), AMB),
    (MalformedResponse("a job without an id"), AMB),
]
STATUSES = [
    (409, "idempotency_key_in_use", NP),
    (404, "upload_not_found", NP),
    (429, None, NP),
    (503, None, NP),
    (502, None, AMB),
    (504, None, AMB),
    (500, None, AMB),
    (422, "idempotency_key_mismatch", ALARM),
    (400, None, REF),
    (401, None, REF),
    (403, None, REF),
    (404, "job_not_found", REF),
    (410, "result_expired", REF),
    (413, "file_too_large", REF),
    (415, "unsupported_format", REF),
    (422, "invalid_options", REF),
    *((status, None, REF) for status in (301, 302, 303, 307, 308)),
]


@pytest.mark.parametrize("exc,outcome", EXCEPTIONS, ids=lambda v: type(v).__name__ if not isinstance(v, (str, Outcome)) else str(v))
def test_transport_failure_rows(exc, outcome):
    assert classify_exception(exc).outcome == outcome


@pytest.mark.parametrize("status,code,outcome", STATUSES)
def test_status_rows(status, code, outcome):
    assert classify_status(status, code).outcome == outcome


def test_every_row_of_the_table_is_covered_by_a_test_above():
    covered_exceptions = {e if isinstance(e, str) else type(e).__name__ for e, _ in EXCEPTIONS}
    covered_statuses = {(s, c) for s, c, _ in STATUSES} | {(s, None) for s, _, _ in STATUSES}
    for row in TABLE:
        if row.exception:
            assert row.exception in covered_exceptions, row
        else:
            assert (row.status, row.code) in covered_statuses, row


def test_redirects_are_refusals_whatever_their_status():
    assert classify_status(399).outcome == REF and classify_status(304).outcome == REF


def test_only_failures_that_say_the_channel_cannot_take_work_at_all_start_an_outage_wait():
    waiting = {r.exception or r.status for r in TABLE if r.unavailable}
    assert waiting == {"ConnectError", "ConnectTimeout", "RefusedStream", "BreakerOpen", 429, 503}
    assert all(r.outcome == NP for r in TABLE if r.unavailable)


def test_refusals_never_count_against_the_breaker():
    assert not any(r.breaker_failure for r in TABLE if r.outcome in (REF, ALARM))


def test_unknown_failures_are_treated_as_ambiguous_not_retried_blindly():
    assert classify_status(599).outcome == AMB
    assert classify_exception(RuntimeError("boom")).outcome == AMB
    assert classify_status(418).outcome == REF
