"""Terminal-state notifications: signed, de-duplicable by event id, retried on their own.

A Notification row is written in the same transaction as the terminal state (see outcomes.py);
delivery is a separate durable retry with backoff and a limit. Nothing here ever re-runs a task.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import random
import socket
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from tasks import timescale
from tasks.errors import InvalidRequest
from tasks.models import Notification, Task
from tasks.observability import log_event

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
    """An http(s) URL with a host; private and loopback addresses only where allowed."""
    if len(url) > 2000:
        raise InvalidRequest("callback_url is too long (2000 characters at most).")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest("callback_url must be an http:// or https:// URL with a host.")
    if parts.username or parts.password:
        raise InvalidRequest("callback_url must not carry credentials.")
    if not settings.CALLBACK_ALLOW_PRIVATE and _is_private_host(parts.hostname):
        raise InvalidRequest("callback_url must point to a public address.")
    return url


def _is_private_host(host: str) -> bool:
    if host in ("localhost",) or host.endswith(".localhost") or host.endswith(".internal"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_private or address.is_loopback or address.is_link_local or address.is_reserved


def _resolves_private(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return any(_is_private_host(info[4][0]) for info in infos)


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
    host = urlsplit(note.url).hostname or ""
    if not settings.CALLBACK_ALLOW_PRIVATE and _resolves_private(host):
        error = "private_address"
    else:
        try:
            response = httpx.post(
                note.url,
                content=body,
                headers={
                    "Content-Type": "application/json",
                    "X-Sluice-Event-Id": str(note.event_id),
                    "X-Sluice-Signature": f"sha256={signature}",
                },
                timeout=httpx.Timeout(
                    connect=timescale.seconds(CONNECT_TIMEOUT_S), read=timescale.seconds(READ_TIMEOUT_S),
                    write=timescale.seconds(READ_TIMEOUT_S), pool=timescale.seconds(CONNECT_TIMEOUT_S),
                ),
                follow_redirects=False,
                trust_env=False,
            )
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
