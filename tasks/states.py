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

# Why a task is waiting: the codes the API returns (stable) and what they mean to a person.
WAITING_REASONS: dict[str, str] = {
    "precheck": "the file is being checked",
    "lane_full": "its lane is full; it starts when there is room",
    "lane_paused": "its lane is paused by an operator",
    "tenant_at_quota": "your organisation has as many tasks running as its quota allows",
    "vendor_budget": "the vendor is busy with as many jobs as we send it at once",
    "breaker_open": "the vendor is failing; Sluice waits for it to recover",
    "fair_share": "other organisations' tasks go first for a moment (fair share)",
    "retry_backoff": "a try failed without being processed; it is tried again shortly",
    "rate_limited": "the vendor asked us to slow down; it is tried again when it said",
    "retry_budget_dry": "many tries failed lately; retries are slowed down",
    "all_channels_down": "every vendor for this kind of work is down; it resumes when one recovers",
    "reconciling": "Sluice is checking with the vendor whether an earlier try was received",
    "waiting_for_vendor_cancel": "the vendor is stopping an earlier try before a new one starts",
    "needs_operator": "the vendor does not answer whether an earlier try was received; an operator is looking",
    "result_rate_limited": "the result is ready; the vendor asked us to wait before downloading it",
    "result_download_retry": "the result is ready; its download failed and is tried again",
}
