"""Console query parameters, checked: a value that cannot be used is a 400 page saying which
parameter and what it takes, never a server error."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.dateparse import parse_datetime
from django.utils.timezone import is_naive, make_aware

# The error-code filter's value for tasks that have no error code.
ERROR_CODE_NONE = "(none)"


class BadInput(ValueError):
    """A console parameter that cannot be used; the message says what to send instead."""


def int_param(request: HttpRequest, name: str, default: int, *, low: int, high: int) -> int:
    raw = request.GET.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadInput(f"{name} must be a whole number from {low} to {high}.") from None
    if not low <= value <= high:
        raise BadInput(f"{name} must be a whole number from {low} to {high}.")
    return value


def datetime_param(name: str, raw: str) -> datetime | None:
    if not raw:
        return None
    try:
        value = parse_datetime(raw.strip())
    except ValueError:
        value = None
    if value is None:
        raise BadInput(f"{name} must be a date and time like 2026-11-29T10:00.")
    return make_aware(value) if is_naive(value) else value


def uuid_or_none(raw: object) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(raw))
    except ValueError:
        return None


def uuid_list(name: str, raw: object) -> list[uuid.UUID]:
    values = raw if isinstance(raw, list) else str(raw).split(",")
    parsed = [uuid_or_none(v.strip()) for v in values if str(v).strip()]
    if not parsed or None in parsed:
        raise BadInput(f"{name} must be task ids (UUIDs), separated by commas.")
    return parsed


class ConsoleBadInput:
    """Under /console/, input the pages could not use answers 400 with the reason."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith("/console/"):
            return None
        if isinstance(exception, BadInput):
            message = str(exception)
        elif isinstance(exception, IncorrectLookupParameters):
            message = f"These filters cannot be applied: {exception}"
        elif isinstance(exception, ValidationError):
            message = "; ".join(exception.messages)
        else:
            return None
        from console.admin_site import site

        context = {**site.each_context(request), "title": "Cannot show this page", "message": message,
                   "back": request.path}
        return TemplateResponse(request, "console/bad_request.html", context, status=400).render()
