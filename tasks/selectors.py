"""Reads. Every query that a tenant's caller can reach is scoped by that tenant."""

from __future__ import annotations

import base64
import uuid
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet

from tasks.errors import FileNotFound, InvalidRequest, TaskNotFound
from tasks.models import FileVersion, Notification, Task, TaskEvent, Tenant
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
    queryset: QuerySet[Task] = Task.objects.select_related("lane", "tenant", "file").filter(tenant=tenant)
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


STAGES = ("queued", "admitted", "uploading", "vendor_queued", "vendor_processing", "fetching", "notifying")


def task_stages(*, task: Task) -> list[dict[str, Any]]:
    """Where the task's time went, stage by stage, for its latest attempt (seed 003: tell "waited
    in the queue" from "hung at the vendor"). A stage not reached has no times; one under way has
    a start and no end. Seconds are real seconds."""
    events = list(TaskEvent.objects.filter(task=task).order_by("at", "id"))
    queued = _last(events, to_state=State.QUEUED)
    started = _last(events, to_state=State.RUNNING, after=queued)
    anchor = started.at if started else None
    created = _last(events, reason_prefix="vendor job created", after=started) or _last(
        events, reason_prefix="reconciled: adopted", after=started)
    processing = _last(events, vendor_status="processing", after=started)
    completed = _last(events, vendor_status="completed", after=started)
    finished = _last(events, to_state=State.SUCCEEDED, after=started)
    note = Notification.objects.filter(task=task).order_by("-generation").first()
    marks = [
        ("queued", queued.at if queued else None, task.dispatched_at or anchor),
        ("admitted", task.dispatched_at if task.dispatched_at and anchor and task.dispatched_at <= anchor else None, anchor),
        ("uploading", anchor, created.at if created else None),
        ("vendor_queued", created.at if created else None, (processing or completed).at if (processing or completed) else None),
        ("vendor_processing", processing.at if processing else None, completed.at if completed else None),
        ("fetching", completed.at if completed else None, finished.at if finished else None),
        ("notifying", finished.at if finished and note else None, note.delivered_at if note else None),
    ]
    now = datetime.now(tz=task.created_at.tzinfo)
    stages = []
    for name, start, end in marks:
        seconds = None
        if start is not None:
            seconds = round(((end or now) - start).total_seconds(), 3)
        stages.append({"stage": name, "started_at": start, "ended_at": end, "seconds": seconds,
                       "running": start is not None and end is None and not task.is_terminal})
    return stages


def _last(events: list[TaskEvent], *, to_state: str | None = None, reason_prefix: str | None = None,
          vendor_status: str | None = None, after: TaskEvent | None = None) -> TaskEvent | None:
    found = None
    for event in events:
        if after is not None and (event.at, event.id) < (after.at, after.id):
            continue
        if to_state is not None and event.to_state != to_state:
            continue
        if reason_prefix is not None and not event.reason.startswith(reason_prefix):
            continue
        if vendor_status is not None and (event.data or {}).get("vendor_status") != vendor_status:
            continue
        found = event
    return found
