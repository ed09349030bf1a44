"""Terminal-state notifications: signed, de-duplicable by event id, retried on their own.

A Notification row is written in the same transaction as the terminal state (see outcomes.py);
delivery is a separate durable retry with backoff and a limit. Nothing here ever re-runs a task.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from tasks import timescale
from tasks.models import Notification, Task
from tasks.observability import log_event
from tasks.outbound import OutboundRefused, Pinned, outbound_pin

BACKOFF_BASE_S = 2.0
BACKOFF_CAP_S = 600.0
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 5.0


def event_payload(task: Task, event_type: str) -> dict[str, Any]:
    """What a receiver learns: ids, state and result digest; never file names or contents."""
    return {
        "id": str(task.id),
        "state": task.state if event_type != "task.succeeded" else "SUCCEEDED",
        # Receivers order a task's events by it: a higher generation is the newer outcome.
        "generation": task.generation,
        "kind": task.kind,
        "target_format": task.target_format,
        "error": {"code": task.error_code, "retryable": task.error_retryable} if task.error_code else None,
        "result": {"sha256": task.result_sha256, "size": task.result_size} if task.result_sha256 else None,
    }


def callback_url_validate(url: str) -> str:
    """An http(s) URL with a public host that resolves (tasks/outbound.py); private and loopback
    addresses only where SLUICE_CALLBACK_ALLOW_PRIVATE allows them."""
    outbound_pin(url, allow_private=settings.CALLBACK_ALLOW_PRIVATE, what="callback_url")
    return url


def _host_header(pinned: Pinned) -> str:
    default = 443 if pinned.scheme == "https" else 80
    return pinned.host if pinned.port == default else f"{pinned.host}:{pinned.port}"


def notification_deliver(*, notification_id: int) -> str:
    """Try one delivery. Safe to call twice at once: only the holder of the lease sends."""
    now = timezone.now()
    lease = now + timedelta(seconds=max(timescale.seconds(CONNECT_TIMEOUT_S + READ_TIMEOUT_S) * 2, 2.0))
    claimed = Notification.objects.filter(
        Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now),
        pk=notification_id, status=Notification.Status.PENDING, next_attempt_at__lte=now,
    ).update(lease_expires_at=lease, status=Notification.Status.DELIVERING)
    if not claimed:
        return "not_due"
    note = Notification.objects.select_related("tenant").get(pk=notification_id)
    body = json.dumps(
        {
            "event": note.event_type,
            "event_id": str(note.event_id),
            "generation": note.generation,
            "occurred_at": note.created_at.isoformat(),
            "task": note.payload,
        },
        separators=(",", ":"),
    ).encode()
    signature = hmac.new(note.tenant.callback_secret.encode(), body, hashlib.sha256).hexdigest()
    status_code = None
    error = ""
    try:
        # Resolved and checked now, and called at exactly that address (no second resolution).
        pinned = outbound_pin(note.url, allow_private=settings.CALLBACK_ALLOW_PRIVATE, what="callback_url")
    except OutboundRefused:
        pinned = None
        error = "refused_address"
    if pinned is not None:
        try:
            timeout = httpx.Timeout(
                connect=timescale.seconds(CONNECT_TIMEOUT_S), read=timescale.seconds(READ_TIMEOUT_S),
                write=timescale.seconds(READ_TIMEOUT_S), pool=timescale.seconds(CONNECT_TIMEOUT_S),
            )
            with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
                request = client.build_request(
                    "POST", pinned.address_url, content=body,
                    headers={
                        "Host": _host_header(pinned),
                        "Content-Type": "application/json",
                        "X-Sluice-Event-Id": str(note.event_id),
                        "X-Sluice-Signature": f"sha256={signature}",
                    },
                    # TLS names and verifies the host the tenant gave, at the address checked.
                    extensions={"sni_hostname": pinned.host} if pinned.scheme == "https" else {},
                )
                response = client.send(request)
            status_code = response.status_code
        except httpx.HTTPError as exc:
            error = type(exc).__name__
    attempts = note.attempts + 1
    if status_code is not None and 200 <= status_code < 300:
        Notification.objects.filter(pk=note.pk).update(
            status=Notification.Status.DELIVERED, attempts=attempts, delivered_at=timezone.now(),
            last_status_code=status_code, last_error="", lease_expires_at=None,
        )
        outcome = "delivered"
    else:
        exhausted = attempts >= note.max_attempts
        delay = random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempts))
        Notification.objects.filter(pk=note.pk).update(
            status=Notification.Status.EXHAUSTED if exhausted else Notification.Status.PENDING,
            attempts=attempts,
            last_status_code=status_code,
            last_error=(error or f"http_{status_code}")[:100],
            next_attempt_at=timescale.after(max(delay, BACKOFF_BASE_S)),
            lease_expires_at=None,
        )
        outcome = "exhausted" if exhausted else "retry"
    log_event(
        "notification_delivery", notification_id=note.pk, task_id=note.task_id, status=status_code,
        exception=error or None, decision=outcome, count=attempts,
    )
    return outcome


def notification_resend(*, notification_id: int) -> bool:
    """An operator sends an exhausted (or delivered) notification again, with the same event id."""
    return bool(
        Notification.objects.filter(
            pk=notification_id, status__in=(Notification.Status.EXHAUSTED, Notification.Status.DELIVERED)
        ).update(status=Notification.Status.PENDING, next_attempt_at=timezone.now(), attempts=0, lease_expires_at=None)
    )
