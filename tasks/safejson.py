"""JSON from strangers (API bodies, vendor callbacks): bounded in size and nesting before it is
parsed, so no input reaches the parser's recursion limit or the memory of a worker."""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32
# Brackets outside strings decide the depth; a string is skipped whole, escapes included.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class JsonRefused(ValueError):
    """Not JSON, or JSON nested deeper than allowed; the message says which."""


def depth_of(data: bytes) -> int:
    depth = deepest = 0
    for token in _TOKENS.finditer(data):
        symbol = token.group()
        if symbol in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif symbol in (b"]", b"}"):
            depth -= 1
    return deepest


def _no_constants(name: str) -> Any:
    raise JsonRefused(f"{name} is not a JSON number.")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JsonRefused(f"The number {text[:40]} is too large.")
    return value


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON refusing, with a message: nesting deeper than `max_depth`, NaN and Infinity
    and numbers too large for a float (not JSON, and not storable as JSON), and NUL characters in strings (no database text type
    stores them)."""
    raw = data.encode() if isinstance(data, str) else data
    # A body with no more opening brackets than the limit (in strings or not) cannot nest deeper:
    # counted in C, the usual body is never walked token by token.
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth_of(raw) > max_depth:
        raise JsonRefused(f"The JSON is nested deeper than {max_depth} levels.")
    try:
        value = json.loads(raw, parse_constant=_no_constants, parse_float=_finite)
    except JsonRefused:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise JsonRefused("The body is not valid JSON.") from None
    if _has_nul(value):
        raise JsonRefused("JSON strings may not contain NUL (\\u0000) characters.")
    return value


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False
