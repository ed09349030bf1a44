"""Task states. The allowed transitions between them live in tasks/lifecycle.py."""

from __future__ import annotations

from django.db import models


class State(models.TextChoices):
    ACCEPTED = "ACCEPTED", "ACCEPTED"
    QUEUED = "QUEUED", "QUEUED"
    RUNNING = "RUNNING", "RUNNING"
    RETRY_WAIT = "RETRY_WAIT", "RETRY_WAIT"
    RECONCILING = "RECONCILING", "RECONCILING"
    CANCEL_REQUESTED = "CANCEL_REQUESTED", "CANCEL_REQUESTED"
    SUCCEEDED = "SUCCEEDED", "SUCCEEDED"
    FAILED = "FAILED", "FAILED"
    CANCELLED = "CANCELLED", "CANCELLED"
    EXPIRED = "EXPIRED", "EXPIRED"


TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED, State.EXPIRED})
ACTIVE_STATES = frozenset(set(State) - TERMINAL_STATES)
# States in which an execution may hold vendor resources (a worker, an upload, a vendor job).
IN_FLIGHT_STATES = frozenset({State.RUNNING, State.RECONCILING, State.CANCEL_REQUESTED})
