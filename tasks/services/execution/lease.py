"""The right to run one step of a task: who holds it, until when, renewed by heartbeats."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connections, router
from django.utils import timezone

from tasks import timescale
from tasks.models import Attempt, Task
from tasks.rows import select, update, update_read, update_sql
from tasks.states import State
from tasks.vendors.errors import StopUpload

S = State
P = Task.Phase


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def actor() -> str:
    return f"worker {worker_id()}"


def lease_seconds() -> float:
    return max(timescale.seconds(settings.LEASE_S), settings.LEASE_FLOOR_S)


# A task whose step may be claimed (parameters: its id, state and generation, now): there, and
# no lease held.
CLAIMABLE = ("t.id = %s AND t.state = %s AND t.generation = %s "
             "AND (t.lease_expires_at IS NULL OR t.lease_expires_at < %s)")


class Lease:
    """The right to run one step of a task at (state, generation), renewed by heartbeats."""

    def __init__(self, task: Task) -> None:
        self.task_id = task.pk
        self.state = task.state
        self.generation = task.generation
        self.owner = worker_id()
        self.expires_at = task.lease_expires_at
        self._next_renewal = 0.0

    @classmethod
    def claim(cls, task: Task) -> Lease | None:
        lease = cls(task)
        now = timezone.now()
        lease.expires_at = now + timedelta(seconds=lease_seconds())
        taken = update(Task, {"lease_owner": lease.owner, "lease_expires_at": lease.expires_at},
                       CLAIMABLE, [("id", task.pk), ("state", task.state), ("generation", task.generation),
                                   ("lease_expires_at", now)])
        if not taken:
            return None
        lease._next_renewal = time.monotonic() + lease_seconds() / 3
        return lease

    @classmethod
    def claim_read(cls, task_id: Any, state: State | str, generation: int, *, related: tuple[str, ...] = (),
                   extra: dict[str, str] | None = None) -> tuple[Task | None, Lease | None]:
        """Claim the step of the task at (state, generation) and read the task (with `related`
        and `extra` as `rows.select` reads them): (None, None) when it is not there any more,
        (the task, None) when another step holds its lease. One statement, the claim's UPDATE
        read back as the task (a read of its own only when nothing was claimed)."""
        def read() -> Task | None:  # the task if it is still at (state, generation)
            task = next(iter(select(Task, "t.id = %s", [("id", task_id)], related=related, extra=extra)), None)
            return task if task is not None and task.state == state and task.generation == generation else None

        now = timezone.now()
        owner = worker_id()
        changes = {"lease_owner": owner, "lease_expires_at": now + timedelta(seconds=lease_seconds())}
        params = [("id", task_id), ("state", state), ("generation", generation), ("lease_expires_at", now)]
        if connections[router.db_for_write(Task)].vendor == "postgresql":
            built = update_sql(Task, changes, CLAIMABLE, params, returning="t.*")
            claimed = select(Task, "TRUE", [], related=related, extra=extra, over=("claimed", built))
        else:  # (SQLite's RETURNING cannot join: the related rows are its subqueries)
            claimed = update_read(Task, changes, CLAIMABLE, params, related=related, extra=extra)
        if not claimed:
            return read(), None
        lease = cls(claimed[0])
        lease._next_renewal = time.monotonic() + lease_seconds() / 3
        return claimed[0], lease

    @classmethod
    def adopt(cls, task: Task) -> Lease:
        """The lease written by the claim transition itself."""
        lease = cls(task)
        lease._next_renewal = time.monotonic() + lease_seconds() / 3
        return lease

    def heartbeat(self, _bytes: int = 0) -> None:
        """Renew between upload chunks; stop if the task was fenced or cancelled meanwhile."""
        if time.monotonic() < self._next_renewal:
            return
        now = timezone.now()
        expires = now + timedelta(seconds=lease_seconds())
        renewed = Task.objects.filter(
            pk=self.task_id, state=self.state, generation=self.generation, lease_owner=self.owner
        ).update(lease_expires_at=expires)
        if not renewed:
            raise StopUpload()
        Attempt.objects.filter(task_id=self.task_id, generation=self.generation).update(
            heartbeat_at=now, lease_expires_at=expires
        )
        self._next_renewal = time.monotonic() + lease_seconds() / 3

    def release(self, *, row: bool = True) -> None:
        """Let the task go. `row=False`: the step's last move already cleared the lease."""
        from tasks.vendors.http import flush_calls

        flush_calls()  # the step's vendor calls are on record once it lets the task go
        if row:
            Task.objects.filter(pk=self.task_id, lease_owner=self.owner).update(lease_owner="", lease_expires_at=None)


def load_task(task_id: Any) -> Task | None:
    """The task with its channel, file, lane and vendor job, in one statement (every step reads it)."""
    return next(iter(select(Task, "t.id = %s", [("id", task_id)], related=("channel", "file", "lane", "vendor_job"))), None)
