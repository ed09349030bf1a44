"""problem+json answers (RFC 9457) with a stable `code`, for the tasks API."""

from __future__ import annotations

import logging
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from tasks.errors import SluiceError
from tasks.observability import log_event


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
            return problem(405, "method_not_allowed", f"{request.method} is not allowed here.")
        if response.status_code == 400:
            return problem(400, "invalid_request", "The request could not be parsed.")
        if response.status_code == 413:
            return problem(413, "file_too_large", "The request body is too large.")
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith("/api/"):
            return None
        if isinstance(exception, SluiceError):
            return problem_from(exception)
        log_event("api_error", logging.ERROR, exception=exception, operation=request.method)
        return problem(500, "internal_error", "Something went wrong on our side; nothing you sent was lost. Retry later.")
