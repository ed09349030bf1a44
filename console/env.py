"""Reading settings from the environment: one helper, clear errors for invalid values."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from django.core.exceptions import ImproperlyConfigured

T = TypeVar("T")


def env(name: str, default: T, cast: Callable[[str], T] | None = None) -> T:
    """Return the environment variable `name` cast like `default`, or `default` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    caster = cast or _caster_for(default)
    try:
        return caster(raw)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not valid: {exc}") from None


def _caster_for(default: object) -> Callable[[str], object]:
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    if isinstance(default, (list, tuple)):
        return parse_list
    return str


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def parse_list(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def parse_mapping(raw: str) -> dict[str, int]:
    """Parse `a=1,b=2` into {"a": 1, "b": 2}."""
    result: dict[str, int] = {}
    for part in parse_list(raw):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{part!r} is not name=number")
        result[key.strip()] = int(value)
    return result


def positive_float_at_most(limit: float) -> Callable[[str], float]:
    def cast(raw: str) -> float:
        value = float(raw)
        if not 0 < value <= limit:
            raise ValueError(f"must be in (0, {limit}]")
        return value

    return cast


def one_of(*choices: str) -> Callable[[str], str]:
    def cast(raw: str) -> str:
        value = raw.strip()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return cast
