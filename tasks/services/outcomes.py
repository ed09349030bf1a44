"""State changes with the side effects that must commit together with them.

`task_move` wraps lifecycle.transition(): in the same transaction it ends the attempt that was
running, releases budget reservations when a task finishes, writes the terminal notification
(an outbox row delivered later, never re-running the task) and dead letters; after it, a task
that ends with more than one vendor job gets its billing check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from django.db import connections, router, transaction
from django.utils import timezone

from tasks import counters, lifecycle
from tasks.models import Attempt, BudgetSlot, DeadLetter, Notification, Task
from tasks.rows import Write, select
from tasks.scheduling.budgets import RESERVED_IN, slots_release
from tasks.services.billing import several_jobs_sql, task_billing_check
from tasks.services.notifications import event_payload
from tasks.states import TERMINAL_STATES, State

WAITING_DEFAULTS = {State.RETRY_WAIT: "retry_backoff", State.RECONCILING: "reconciling"}
EVENT_TYPES = {
    State.SUCCEEDED: "task.succeeded",
    State.FAILED: "task.failed",
    State.CANCELLED: "task.cancelled",
    State.EXPIRED: "task.expired",
}

# What the terminal moves made in this context said of the lanes, by task: whether some lane held
# tasks waiting for admission as the task left its slots (see `listening`).
_HEARD: ContextVar[dict[str, bool] | None] = ContextVar("lanes_waiting_heard", default=None)


@dataclass(frozen=True)
class LeftBehind:
    """What a terminal move's own statement said of what the task leaves behind (its `returning`),
    so that what comes after the move reads only what there is."""

    outbox: bool  # a callback URL (the task's or its tenant's), or an older event still pending
    several_jobs: bool  # more than one vendor job recorded for the task: its billing check has work
    lanes_waiting: bool  # some lane holds tasks waiting for admission: the slots it frees are wanted
    slots_open: bool  # the task still holds budget slots (see `task_move` for when this is trusted)

    @classmethod
    def of(cls, moved: lifecycle.Moved | None) -> LeftBehind | None:
        """What the move said; None if it did not move, or said nothing (the caller reads instead)."""
        if moved is None or moved.said is None or len(moved.said) != len(dataclasses.fields(cls)):
            return None
        return cls(*(bool(value) for value in moved.said))


@contextlib.contextmanager
def listening() -> Iterator[dict[str, bool]]:
    """Hear what the terminal moves made inside the block said of the lanes: task id → whether
    some lane held tasks waiting for admission as it left (a worker's step learns so whether the
    slots its task left are wanted without reading the lanes again)."""
    heard: dict[str, bool] = {}
    token = _HEARD.set(heard)
    try:
        yield heard
    finally:
        _HEARD.reset(token)


def task_move(
    task_id: Any,
    *,
    source: State | str,
    target: State | str,
    generation: int,
    actor: str,
    reason: str,
    fields: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    attempt_outcome: str | None = None,
    attempt_fields: dict[str, Any] | None = None,
    dead_letter_class: str | None = None,
    expect: dict[str, Any] | None = None,
    writes: tuple[Write, ...] = (),
) -> lifecycle.Moved | None:
    """Move the task (lifecycle.transition) with what must commit with the move: the running
    attempt's end (`attempt_outcome`, and `attempt_fields` it learnt and has not written yet), a
    terminal move's slot release and notification, a dead letter. `expect`: columns that must
    still hold what the caller read for the task to move. `writes`: more that commits with the
    move (`lifecycle.transition`'s)."""
    target = State(target)
    fields = dict(fields or {})
    now = timezone.now()
    if target in TERMINAL_STATES:
        fields.setdefault("finished_at", now)
        fields.setdefault("due_at", None)
        fields.setdefault("phase", "")
    # Why a task waits is written with the move into a waiting state and cleared by any other.
    fields.setdefault("waiting_reason", WAITING_DEFAULTS.get(target, ""))
    # The attempt's end is written with the move (in its statement on PostgreSQL).
    ended = (Write.change(Attempt, {**(attempt_fields or {}), "ended_at": now, "outcome": attempt_outcome,
                                    "error_code": (fields.get("error_code") or "")[:64],
                                    "error_class": (data or {}).get("error_class", "")[:32]},
                          {"task": task_id, "generation": generation, "ended_at": None}),) if attempt_outcome else ()
    # A task's last move outside any caller's transaction also writes the vendor calls its step
    # made so far (in its statement on PostgreSQL; the step's end wrote them one statement later),
    # whatever came of the move; they are written later if it fails.
    calls = _calls_so_far() if target in TERMINAL_STATES and not transaction.get_connection().in_atomic_block else []
    logged = (Write.insert(calls, if_moved=False),) if calls else ()
    try:
        moved = _moved(task_id, source=source, target=target, generation=generation, actor=actor, reason=reason,
                       fields=fields, data=data, writes=ended + logged + writes, dead_letter_class=dead_letter_class,
                       expect=expect)
    except BaseException:
        _put_back(calls)
        raise
    if moved is None:
        return None
    moved, left = moved
    if target in TERMINAL_STATES and (left is None or left.several_jobs):
        # A task that ends with a second job has its incident name them all and the one it kept,
        # whatever became of the checks when each job was recorded (a step that died between
        # recording a job and checking it). A job recorded after the move is checked by whoever
        # records it.
        task_billing_check(task_id)
    return moved


def _moved(task_id: Any, *, source: State | str, target: State, generation: int, actor: str, reason: str,
           fields: dict[str, Any], data: dict[str, Any] | None, writes: tuple[Write, ...],
           dead_letter_class: str | None, expect: dict[str, Any] | None) -> tuple[lifecycle.Moved, LeftBehind | None] | None:
    """task_move's transaction: the move with its writes, a terminal move's slot release and
    notification, a dead letter; the move and what it said the task leaves behind."""
    with transaction.atomic():
        moved = lifecycle.transition(
            task_id, source=source, target=target, generation=generation, actor=actor, reason=reason,
            fields=fields, data=data, returning=_left_behind() if target in TERMINAL_STATES else (), writes=writes,
            expect=expect,
        )
        if moved is None:
            return None
        left = LeftBehind.of(moved)
        if target in TERMINAL_STATES:
            if left is None or left.slots_open or State(source) in RESERVED_IN:
                # Slots are reserved only for a task in these states, under its row's lock and
                # without moving it on (budgets.slots_reserve): a move from one of them may have
                # waited for that lock, and on PostgreSQL its statement reads from before the
                # slots committed, so it releases whatever it said. A move from any other state
                # found the task where no slot can be added to it: what it said holds.
                slots_release(task_id, reason=f"task {target.lower()}")
            if left is None or left.outbox:
                _notification_outbox(task_id, target, moved.generation)
            heard = _HEARD.get()
            if left is not None and heard is not None:
                heard[str(task_id)] = left.lanes_waiting
        if dead_letter_class:
            task = Task.objects.only("tenant_id", "attempts").get(pk=task_id)
            DeadLetter.objects.create(
                task_id=task_id, tenant_id=task.tenant_id, error_class=dead_letter_class,
                error_code=(fields.get("error_code") or "unknown")[:64], attempts=task.attempts,
            )
    return moved, left


def _calls_so_far() -> list:
    """The vendor calls this process made and has not written yet (tasks.vendors.http)."""
    from tasks.vendors.http import take_calls

    return take_calls()


def _put_back(calls: list) -> None:
    if calls:
        from tasks.vendors.http import put_back_calls

        put_back_calls(calls)


_LEFT_BEHIND: dict[str, tuple[str, str, str, str]] = {}


def _left_behind() -> tuple[str, str, str, str]:
    """What a terminal move's own statement says of what the task leaves behind (`LeftBehind`), as SQL
    over the moved row (`lifecycle.transition`'s `returning`): whether the outbox has anything to
    write (a callback URL, the task's or its tenant's, or an older event still pending there),
    whether the task has more than one vendor job (its billing check), whether any lane holds
    tasks waiting for admission, whether the task still holds budget slots. Most tasks have no
    callback and one job, most moves find no lane waiting, and a task that ends after its job
    was bound released its slots then: nothing more is read or written for them."""
    connection = connections[router.db_for_write(Task)]  # where the move's statement runs
    if connection.vendor not in _LEFT_BEHIND:
        quote = connection.ops.quote_name
        tenant, notification = Task._meta.get_field("tenant"), Notification._meta.get_field("task")
        pk = f"{{row}}.{quote(Task._meta.pk.column)}"
        pending = Notification.Status.PENDING.value
        assert pending.isidentifier()  # written into the statement as it is
        outbox = (
            f"CASE WHEN COALESCE({{row}}.{quote(Task._meta.get_field('callback_url').column)}, '') <> '' "
            f"OR EXISTS (SELECT 1 FROM {quote(tenant.related_model._meta.db_table)} o "
            f"WHERE o.{quote(tenant.target_field.column)} = {{row}}.{quote(tenant.column)} "
            f"AND o.{quote(tenant.related_model._meta.get_field('callback_url').column)} <> '') "
            f"OR EXISTS (SELECT 1 FROM {quote(Notification._meta.db_table)} n "
            f"WHERE n.{quote(notification.column)} = {pk} "
            f"AND n.{quote(Notification._meta.get_field('status').column)} = '{pending}') THEN 1 ELSE 0 END")
        several_jobs = several_jobs_sql()
        lanes_waiting = f"CASE WHEN EXISTS ({counters.LANES_WITH_QUEUED}) THEN 1 ELSE 0 END"
        slot = BudgetSlot._meta.get_field("task")
        slots_open = (f"CASE WHEN EXISTS (SELECT 1 FROM {quote(BudgetSlot._meta.db_table)} s "
                      f"WHERE s.{quote(slot.column)} = {pk} "
                      f"AND s.{quote(BudgetSlot._meta.get_field('released_at').column)} IS NULL) THEN 1 ELSE 0 END")
        _LEFT_BEHIND[connection.vendor] = (outbox, several_jobs, lanes_waiting, slots_open)
    return _LEFT_BEHIND[connection.vendor]


def _notification_outbox(task_id: Any, target: State, generation: int) -> None:
    """The terminal event, to be delivered later; it supersedes any older one not yet delivered
    (a replayed dead letter that succeeds must not be heard as "failed" after "succeeded")."""
    older = Notification.objects.filter(task_id=task_id, generation__lt=generation, status=Notification.Status.PENDING)
    pending = (f"EXISTS (SELECT 1 FROM {Notification._meta.db_table} n WHERE n.task_id = t.id "
               f"AND n.generation < %s AND n.status = %s)")
    found = select(Task, "t.id = %s", [(None, generation), (None, Notification.Status.PENDING.value), ("id", task_id)],
                   related=("tenant",), extra={"older_pending": pending})
    if not found:
        raise Task.DoesNotExist(f"task {task_id}")
    task = found[0]
    url = task.callback_url or task.tenant.callback_url
    if task.older_pending:
        older.update(status=Notification.Status.SUPERSEDED, lease_expires_at=None)
    if not url:
        return
    Notification.objects.get_or_create(
        task=task,
        generation=generation,
        defaults=dict(
            tenant=task.tenant, url=url, event_type=EVENT_TYPES[target],
            payload=event_payload(task, EVENT_TYPES[target]), next_attempt_at=timezone.now()
        ),
    )
