"""One setting multiplies every interval in the system (SLUICE_TIME_SCALE).

Production code reads durations through these helpers, so fault scenarios written in real
seconds run in a fraction of the time without mocking the clock. Durations a vendor sends us
(Retry-After) are nominal seconds too and are scaled the same way.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone


def scale() -> float:
    return float(settings.TIME_SCALE)


def seconds(nominal: float) -> float:
    """Real seconds for a nominal duration."""
    return nominal * scale()


def delta(nominal: float) -> timedelta:
    return timedelta(seconds=seconds(nominal))


def after(nominal: float, *, now: datetime | None = None) -> datetime:
    """The moment `nominal` scaled seconds from now."""
    return (now or timezone.now()) + delta(nominal)


def nominal(real_seconds: float) -> float:
    """Nominal seconds for a measured real duration (for reports)."""
    return real_seconds / scale()
