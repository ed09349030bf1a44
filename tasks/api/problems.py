"""problem+json answers (RFC 9457) with a stable `code`, for the tasks API."""

from __future__ import annotations

import logging
from typing import Any

from django import db
from django.core.exceptions import (
    BadRequest,
    PermissionDenied,
    RequestDataTooBig,
    SuspiciousOperation,
)
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError

from tasks.errors import SluiceError
from tasks.observability import log_event

# Django answers these itself (400, 403, 404); the middleware only reshapes the answer.
DJANGO_CLIENT_ERRORS = (BadRequest, PermissionDenied, SuspiciousOperation, MultiPartParserError, Http404)


def problem(status: int, code: str, detail: str, *, retry_after: float | None = None, **extra: Any) -> JsonResponse:
    body = {
        "type": f"https://sluice.invalid/problems/{code}",
        "title": code.replace("_", " ").capitalize(),
        "status": status,
        "code": code,
        "detail": detail,
        **{k: v for k, v in extra.items() if v is not None},
    }
    response = JsonResponse(body, status=status, content_type="application/problem+json")
    if retry_after is not None:
        response["Retry-After"] = str(max(int(round(retry_after + 0.499)), 1))
    return response


def problem_from(error: SluiceError) -> JsonResponse:
    return problem(error.status, error.code, error.detail, retry_after=error.retry_after, **error.extra)


# Parts of an error's location that are not field names: where the value came from, the body
# parameter, and the kind a submission's variant is chosen by.
_NOT_FIELDS = {"body", "query", "header", "path", "form", "file", "cookie", "transcription", "conversion"}


def validation_problem(errors: list[dict[str, Any]]) -> JsonResponse:
    """A request that does not fit its declaration: 400 invalid_request naming the first field
    to fix and saying how."""
    detail, field = validation_detail(errors)
    return problem(400, "invalid_request", detail, field=field)


def validation_detail(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """What to fix first in a body that does not fit its declaration, and in which field."""
    first = errors[0] if errors else {"type": "", "msg": "The request is not valid", "loc": ()}
    location = [part for part in first.get("loc", ()) if isinstance(part, str)]
    names = [part for part in location if part not in _NOT_FIELDS]
    field = names[-1] if names else None
    kind = next((part for part in location if part in ("transcription", "conversion")), None)
    error_type, ctx = first.get("type", ""), first.get("ctx") or {}
    if error_type == "extra_forbidden":
        unknown = sorted({str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden"})
        return f"Unknown field(s): {', '.join(unknown)}.", unknown[0]
    if error_type in ("union_tag_invalid", "union_tag_not_found"):
        return f"kind must be one of: {ctx.get('expected_tags')}.", "kind"
    if error_type == "missing" and field:
        hint = ": the id returned by POST /api/v1/files" if field == "file_id" else ""
        detail = f"{field} is required{hint}."
    elif error_type == "literal_error" and field:
        scope = f" for {kind}" if kind and field == "target_format" else ""
        detail = f"{field}{scope} must be one of: {ctx.get('expected')}."
    elif not field:
        detail = "Send a JSON object in the body." if error_type.endswith("_type") or error_type == "missing" else f"{first.get('msg')}."
    else:
        detail = f"{field}: {str(first.get('msg')).removeprefix('Value error, ')}."
    return detail, field


class ProblemJsonMiddleware:
    """Under /api/, answers that Django would render as HTML pages become problem+json."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if not request.path.startswith("/api/") or response.get("Content-Type", "").startswith("application/"):
            return response
        if response.status_code == 404:
            return problem(404, "not_found", "No such resource.")
        if response.status_code == 405:
            answer = problem(405, "method_not_allowed", f"{request.method} is not allowed here; use {response.get('Allow', 'another method')}.")
            if response.has_header("Allow"):
                answer["Allow"] = response["Allow"]
            return answer
        if response.status_code == 400:
            return problem(400, "invalid_request", "The request could not be parsed.")
        if response.status_code == 403:
            return problem(403, "forbidden", "You are not allowed to do this.")
        if response.status_code == 413:
            return problem(413, "payload_too_large", "The request body is too large.")
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith("/api/"):
            return None
        if isinstance(exception, SluiceError):
            return problem_from(exception)
        if isinstance(exception, RequestDataTooBig):
            return problem(413, "payload_too_large", "The request body is larger than this endpoint accepts.")
        if isinstance(exception, DJANGO_CLIENT_ERRORS):
            return None  # Django answers these 400/403/404; __call__ turns them into problem+json
        if isinstance(exception, db.OperationalError | db.InterfaceError):
            # The database cannot be reached (down, failing over, cut off, locked).
            log_event("api_error", logging.ERROR, exception=exception, operation=request.method,
                      reason="database_unavailable")
            answer = problem(503, "database_unavailable",
                             "Sluice could not reach its database. Retry shortly with the same Idempotency-Key: "
                             "if this request was accepted after all, you get its task, never a second one.")
            answer["Retry-After"] = "5"
            return answer
        log_event("api_error", logging.ERROR, exception=exception, operation=request.method)
        return problem(500, "internal_error", "Something went wrong on our side; nothing you sent was lost. Retry later.")
