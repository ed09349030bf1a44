"""Reads. Every query that a tenant's caller can reach is scoped by that tenant."""

from __future__ import annotations

import base64
import uuid
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet

from tasks.errors import FileNotFound, InvalidRequest, TaskNotFound
from tasks.models import FileVersion, Task, TaskEvent, Tenant
from tasks.states import State


def _uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def task_get(*, tenant: Tenant, task_id: Any) -> Task:
    task = Task.objects.select_related("lane", "tenant", "file").filter(pk=_uuid(task_id), tenant=tenant).first()
    if task is None:
        raise TaskNotFound()
    return task


def file_get(*, tenant: Tenant, file_id: Any) -> FileVersion:
    file = FileVersion.objects.filter(pk=_uuid(file_id), tenant=tenant, deleted_at__isnull=True).first()
    if file is None:
        raise FileNotFound("No such file for this tenant.")
    return file


def task_list(*, tenant: Tenant, state: str | None = None, limit: int = 50, cursor: str | None = None) -> tuple[list[Task], str | None]:
    queryset: QuerySet[Task] = Task.objects.select_related("lane", "tenant").filter(tenant=tenant)
    if state:
        states = state.split(",")
        for value in states:
            if value not in State.values:
                raise InvalidRequest(f"state must be among: {', '.join(State.values)}.", field="state")
        queryset = queryset.filter(state__in=states)
    if cursor:
        created, task_id = _decode_cursor(cursor)
        queryset = queryset.filter(Q(created_at__lt=created) | Q(created_at=created, id__lt=task_id))
    rows = list(queryset.order_by("-created_at", "-id")[: limit + 1])
    next_cursor = _encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    return rows[:limit], next_cursor


def _encode_cursor(task: Task) -> str:
    raw = f"{task.created_at.isoformat()}|{task.pk}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, task_id = raw.split("|", 1)
        return datetime.fromisoformat(created), uuid.UUID(task_id)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("cursor is not valid: use next_cursor from the previous page.", field="cursor") from None


def task_events(*, task: Task) -> list[TaskEvent]:
    return list(task.events.order_by("at", "id"))
