"""Small helpers every part of the fake vendor answers with: JSON, problems, query values."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from fakevendor.transport import reason

JSON = [("Content-Type", "application/json")]
# An answer before it is sent: status, headers, body (bytes, or a Path streamed from disk).
Answer = tuple


def json_bytes(data: Any) -> bytes:
    return json.dumps(data).encode()


def ok(data: Any, status: int = 200, extra: list | None = None) -> Answer:
    return status, [*JSON, *(extra or [])], json_bytes(data)


def problem(status: int, code: str, detail: str, *, retryable: bool = False, extra: list | None = None,
            field: str | None = None) -> Answer:
    payload = {"type": f"https://sluice.invalid/vendor/{code}", "title": reason(status).decode() or code,
               "status": status, "code": code, "detail": detail, "retryable": retryable}
    if field:
        payload["field"] = field
    return status, [("Content-Type", "application/problem+json"), *(extra or [])], json_bytes(payload)


def json_field(body: bytes, name: str) -> str | None:
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def int_arg(value: str | None, default: int, low: int, high: int) -> int:
    try:
        return min(max(int(value), low), high) if value is not None else default
    except ValueError:
        return default


def float_arg(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def parse_time(value: str) -> float | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
