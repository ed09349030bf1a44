"""Structured logs from a whitelist of fields.

Log records carry only whitelisted fields: never filenames, contents, keys, tokens, signed URLs
or callback bodies. Exception texts are reduced to their class name before they are logged.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

# Fields a log line may carry. Anything else passed to log_event() is dropped.
LOG_FIELDS = frozenset(
    {
        "event",
        "task_id",
        "tenant_id",
        "attempt",
        "generation",
        "channel",
        "operation",
        "status",
        "exception",
        "duration_ms",
        "bytes",
        "decision",
        "retry_after_s",
        "state",
        "from_state",
        "to_state",
        "lane",
        "reason",
        "code",
        "count",
        "kind",
        "size",
        "pid",
        "host",
        "vendor_job_id",
        "breaker",
        "delay_s",
        "step",
        "notification_id",
        "file_id",
        "detected_type",
        "scenario",
        "submitted_at",
        "started_at",
        "elapsed_s",
    }
)

logger = logging.getLogger("sluice")


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    safe = {k: _scalar(v) for k, v in fields.items() if k in LOG_FIELDS and v is not None}
    logger.log(level, event, extra={"sluice": {"event": event, **safe}})


def _scalar(value: Any) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, BaseException):
        return type(value).__name__
    return str(value)[:120]


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Foreign records keep only their logger, level and a class name."""

    host = socket.gethostname()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "logger": record.name,
            "pid": os.getpid(),
        }
        payload = getattr(record, "sluice", None)
        if payload is not None:
            entry.update(payload)
        else:
            # Third-party messages may interpolate request data (paths, names): keep the
            # template only, never the arguments, and never exception texts.
            entry["message"] = str(record.msg)[:200]
        if record.exc_info and record.exc_info[0] is not None:
            entry["exception"] = record.exc_info[0].__name__
        return json.dumps(entry, default=str)

