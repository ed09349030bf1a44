"""Template filters shared by the portal and the console: times that read, plain words for codes."""

from __future__ import annotations

from datetime import datetime
from datetime import timezone as dt_timezone

from django import template
from django.utils import timezone
from django.utils.html import format_html

from tasks import wording

register = template.Library()


@register.filter
def when(value: datetime | None, style: str = "relative"):
    """One format everywhere: an absolute UTC time the browser shows in the viewer's zone,
    relative ("3 min ago") with the absolute value on hover, or with style "absolute" (timelines)
    the exact time with the relative one on hover (static/sluice/time.js). Without JavaScript the
    UTC time stays, labelled."""
    if not value:
        return "—"
    utc = value.astimezone(dt_timezone.utc) if timezone.is_aware(value) else value
    exact = style == "absolute"
    text = f"{utc:%Y-%m-%d %H:%M:%S}" + (f".{utc.microsecond // 1000:03d}" if exact else "") + " UTC"
    return format_html('<time datetime="{}" data-when="{}" title="{}">{}</time>', utc.isoformat(),
                       "absolute" if exact else "relative", text, text)


@register.filter
def duration(seconds: float | None) -> str:
    """Seconds for people: 850 ms, 12.4 s, 3 min 20 s, 2 h 5 min, 3 d 4 h."""
    if seconds is None or seconds == "":
        return "—"
    s = float(seconds)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    minutes, sec = divmod(int(round(s)), 60)
    if minutes < 60:
        return f"{minutes} min {sec} s" if sec else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


@register.filter
def waiting_words(code: str | None) -> str:
    return wording.waiting_words(code)


@register.filter
def quarantine_words(code: str | None) -> str:
    return wording.quarantine_words(code)


@register.filter
def task_error_words(task) -> str:
    """Why a task failed, in a sentence (the pre-check's own finding for a quarantined file)."""
    return wording.error_words(task.error_code, findings=task.file.precheck_findings if task.file_id else None)


@register.filter
def error_words(code: str | None) -> str:
    return wording.error_words(code)


@register.filter
def readable(value) -> str:
    """A value for people instead of a Python repr: "key: value · key: value", lists comma-separated."""
    if isinstance(value, dict):
        return " · ".join(f"{k}: {readable(v)}" for k, v in value.items()) or "—"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(readable(v) for v in value) or "—"
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
