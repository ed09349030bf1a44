"""The dispatcher: finds due work in the task table and sends the messages that trigger it.

It runs as a loop (`manage.py dispatcher`, one or more per installation, on any host), is also
called right after events (intake commit, a step finishing, a slot freed), and as a django-q2
schedule every minute for safety. Every pass is safe to run concurrently: admission happens
under one database lock, everything else is a compare-and-set per row.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks import counters, lifecycle, timescale
from tasks.lifecycle import task_update
from tasks.models import Attempt, ChannelHealth, Lane, Notification, Task, VendorJob
from tasks.observability import log_event
from tasks.precheck.sandbox import kill_orphans
from tasks.queueing import lane_read, queue_backlog, send, send_step
from tasks.rows import Write, planned_for_its_values, select
from tasks.scheduling import quotas
from tasks.scheduling.admission import AdmissionPolicy, Head, Share
from tasks.scheduling.budgets import UPLOAD, slots_release, slots_reserve, slots_reserved
from tasks.scheduling.channels import ChannelRoom, channel_rooms, channels_down_for, pick_channel
from tasks.scheduling.lanes import lane_slots_by_tenant, lane_with_slots_and_rooms
from tasks.services.execution import claim, claim_attempt, new_operation_fields
from tasks.services.history import history_rollup_due
from tasks.services.outcomes import task_move
from tasks.states import IN_FLIGHT_STATES, TERMINAL_STATES, State
from tasks.table_statistics import statistics_refresh_due
from tasks.vendors import breaker
from tasks.vendors.policies import BreakerPolicy, RetryPolicy

S = State
B = ChannelHealth.Breaker
ACTOR = "dispatcher"
BATCH = 200
# A sent message nobody picked up within this many nominal seconds is sent again (never sooner
# than the floor in real seconds). While the lane's queue still holds messages the one we sent is
# most likely waiting its turn, not lost: it is presumed lost only BUSY_FACTOR times later, so a
# backlog is not doubled by resends and a message lost under sustained load is still recovered.
REDISPATCH_AFTER_S = 10.0
REDISPATCH_FLOOR_S = 2.0
REDISPATCH_BUSY_FACTOR = 10


def resend_cutoff(now: datetime, *, busy: bool = False) -> datetime:
    seconds = max(timescale.seconds(REDISPATCH_AFTER_S), REDISPATCH_FLOOR_S)
    return now - timedelta(seconds=seconds * (REDISPATCH_BUSY_FACTOR if busy else 1))


class Backlogs:
    """Whether a cluster's queue holds messages nobody has taken yet; asked once per tick."""

    def __init__(self) -> None:
        self._known: dict[str | None, bool] = {}

    def busy(self, lane: str | None) -> bool:
        if lane not in self._known:
            self._known[lane] = queue_backlog(lane) > 0
        return self._known[lane]


def presumed_lost(enqueued_at: datetime | None, now: datetime, lane: str | None, backlogs: Backlogs) -> bool:
    if enqueued_at is None or enqueued_at >= resend_cutoff(now):
        return False
    return enqueued_at < resend_cutoff(now, busy=True) or not backlogs.busy(lane)


_LOCK_KEY = 0x51_1CE


@contextlib.contextmanager
def dispatch_lock() -> Iterator[None]:
    """One admission decision at a time across every process and host."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_KEY])
        # SQLite: the IMMEDIATE transaction already excludes every other writer.
        yield


def tick(*, now: datetime | None = None, full: bool = True) -> dict[str, int]:
    """One pass over everything that may be due. Returns counts, for logs and tests.

    What moves work along (retries, admission, due steps) runs every pass; the safety nets and
    housekeeping (deadlines, the watchdog, lost starts, probes, ledger syncs, notifications,
    vendor-job clean-up, history, PostgreSQL's statistics of grown tables) only in a full pass:
    the dispatcher loop runs one every DISPATCH_FULL_TICK_S, so a short tick for low latency does
    not cost a core. One statement first asks which of them have anything to do; an idle pass
    costs that one statement (and, every few seconds on PostgreSQL, a question of its counters)."""
    now = now or timezone.now()
    passes = _FULL_PASSES if full else _SHORT_PASSES
    due = _which_have_rows({name: (probe, now) for name, (probe, _) in passes.items()})
    counts: dict[str, int] = {}
    for name, (_, run) in passes.items():
        counts[name] = run(now) if name in due else 0
        if counts[name]:
            due = set(passes)  # what a pass did may be work for the next ones (a retry due now is admitted now)
    if full:
        counts["history"] = history_rollup_due(now)
        counts["statistics"] = len(statistics_refresh_due())
    busy = {k: v for k, v in counts.items() if v and k not in ("history", "statistics")}
    if busy:
        log_event("dispatch_tick", count=sum(busy.values()), reason=",".join(f"{k}={v}" for k, v in busy.items()))
    return counts


def _which_have_rows(probes: dict[str, tuple[Callable[[datetime], QuerySet], datetime]]) -> set[str]:
    """The names of the probes (a queryset of `now`, and the `now`) that find at least one row,
    in one statement."""
    parts, params = [], []
    for probe, now in probes.values():
        sql, values = _probe_sql(probe, now)
        parts.append(f"EXISTS ({sql})")
        params.extend(values)
    # Planned for its values at every tick (PostgreSQL): the probes find their rows through
    # partial indexes (a state, a moment), which a prepared statement's generic plan cannot use.
    # Prepared on the connection (settings: prepare_threshold), it was planned for its values five
    # times and then kept a generic plan, which read the task table's history at every tick
    # (55-95 ms of the database's CPU a full tick after the benchmark's first sections, 200-800 ms
    # over 100,000 finished tasks, a full tick every 0.4 s; 10-15 ms planned for its values).
    with planned_for_its_values(Task), connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(parts), params)
        row = cursor.fetchone()
    return {name for name, found in zip(probes, row, strict=True) if found}


@dataclass(frozen=True)
class _Kept:
    """A probe's parameter: a value, or a moment `offset` from `now` (passed on as text where the
    backend passes moments on as text: SQLite)."""
    value: Any = None
    offset: timedelta | None = None
    as_text: bool = False

    def at(self, now: datetime) -> Any:
        if self.offset is None:
            return self.value
        moment = now + self.offset
        return connection.ops.adapt_datetimefield_value(moment) if self.as_text else moment


_Shape = tuple[str, list[_Kept]]
_SHAPES: dict[tuple, _Shape | None] = {}
_FIRST = datetime(2000, 1, 1, tzinfo=UTC)
_SECOND = _FIRST + timedelta(days=400, seconds=7)


def _probe_sql(probe: Callable[[datetime], QuerySet], now: datetime) -> tuple[str, list[Any]]:
    """`probe(now)`'s statement, as the ORM compiles it. The ORM compiles it once, at two moments,
    and the statement is kept when the two differ only in values that follow the clock (now, or
    now less a fixed time); a tick then only computes those values (compiling the probes cost an
    idle dispatcher most of its CPU: fourteen querysets a tick, five ticks a second). A probe
    whose statement changes otherwise with `now` is compiled every time."""
    key = (probe, connection.alias, timescale.scale())
    if key not in _SHAPES:
        _SHAPES[key] = _clock_shape(probe)
    shape = _SHAPES[key]
    if shape is None:
        return _compiled(probe(now))
    sql, kept = shape
    return sql, [parameter.at(now) for parameter in kept]


def _compiled(queryset: QuerySet) -> tuple[str, list[Any]]:
    sql, values = queryset.values("pk")[:1].query.sql_with_params()
    return sql, list(values)


def _clock_shape(probe: Callable[[datetime], QuerySet]) -> _Shape | None:
    (sql, first), (again, second) = _compiled(probe(_FIRST)), _compiled(probe(_SECOND))
    if sql != again or len(first) != len(second):
        return None
    kept: list[_Kept] = []
    for one, other in zip(first, second, strict=True):
        if one == other:
            kept.append(_Kept(value=one))
            continue
        # A moment as the ORM passes it on: a datetime, or (SQLite) the backend's text of it,
        # compared with the first moment passed on the same way.
        as_text = isinstance(one, str) and isinstance(other, str)
        if as_text:
            at_first, at_second = parse_datetime(one), parse_datetime(other)
            base = parse_datetime(connection.ops.adapt_datetimefield_value(_FIRST))
        elif isinstance(one, datetime) and isinstance(other, datetime) and timezone.is_aware(one):
            at_first, at_second, base = one, other, _FIRST
        else:
            return None
        if at_first is None or at_second is None or at_second - at_first != _SECOND - _FIRST:
            return None
        kept.append(_Kept(offset=at_first - base, as_text=as_text))
    return sql, kept


# --- deadlines -------------------------------------------------------------------------------
def _past_queue_deadline(now: datetime) -> QuerySet:
    return Task.objects.filter(
        Q(state=S.QUEUED, dispatched_at__isnull=True) | Q(state=S.ACCEPTED, deferred=True), queue_deadline_at__lt=now,
    )


def expire_queue_deadlines(now: datetime) -> int:
    """A task that could not start before its queue deadline is EXPIRED, never dispatched late."""
    expired = 0
    rows = _past_queue_deadline(now).values("pk", "state", "generation")[:BATCH]
    for row in rows:
        if task_move(
            row["pk"], source=row["state"], target=S.EXPIRED, generation=row["generation"], actor=ACTOR,
            reason="queue deadline passed before a worker could start it",
            fields=dict(error_code="queue_deadline_exceeded", error_message="waited longer than the lane's queue deadline"),
        ):
            expired += 1
    return expired


# The states a business deadline still fails a task in: named, so that the probe reads an index
# range per state instead of every finished task ("not finished" is most of the table).
DEADLINE_STATES = tuple(s for s in S if s not in TERMINAL_STATES and s != S.CANCEL_REQUESTED)


def _past_business_deadline(now: datetime) -> QuerySet:
    return Task.objects.filter(state__in=DEADLINE_STATES, deadline_at__lt=now)


def enforce_business_deadlines(now: datetime) -> int:
    """Past its business deadline a task FAILS with deadline_exceeded; its vendor job is cancelled."""
    failed = 0
    rows = list(_past_business_deadline(now).values(
        "pk", "state", "generation", "vendor_job_id", "retries", "waiting_reason")[:BATCH])
    for row in rows:
        waiting = f" while waiting ({row['waiting_reason']})" if row["waiting_reason"] else ""
        moved = task_move(
            row["pk"], source=row["state"], target=S.FAILED, generation=row["generation"], actor=ACTOR,
            reason=f"business deadline passed{waiting}",
            fields=dict(error_code="deadline_exceeded", error_message=f"the task's business deadline passed{waiting}",
                        error_retryable=True, lease_owner="", lease_expires_at=None),
            attempt_outcome=Attempt.Outcome.FENCED,
            dead_letter_class="deadline" if row["retries"] else None,
        )
        if moved:
            failed += 1
            VendorJob.objects.filter(task_id=row["pk"], terminal_at__isnull=True).update(cancel_requested_at=now)
    return failed


def _fenceable(now: datetime) -> QuerySet:
    return Task.objects.filter(Q(state__in=IN_FLIGHT_STATES, lease_expires_at__lt=now)
                               | Q(state=S.RUNNING, attempt_deadline_at__lt=now))


def watchdog(now: datetime) -> int:
    """Fence attempts whose lease expired (a lost worker) or that ran past their execution timeout.

    Each fence records which worker (pid, host) held the step and writes one log line with the
    task, its kind, when it was submitted and started, how long it ran and where it was; the
    worker itself is killed by django-q2 at the step's own timeout (queueing.step_timeout_s)."""
    fenced = 0
    columns = ("pk", "state", "generation", "lease_owner", "lease_expires_at", "kind", "created_at", "started_at", "phase")
    expired = Task.objects.filter(state__in=IN_FLIGHT_STATES, lease_expires_at__lt=now).values(*columns)[:BATCH]
    for row in expired:
        attempt = Attempt.objects.filter(task_id=row["pk"], ended_at__isnull=True).order_by("-generation").first()
        seen = _holder(row, attempt)
        target = S.CANCEL_REQUESTED if row["state"] == S.CANCEL_REQUESTED else S.RECONCILING
        moved = task_move(
            row["pk"], source=row["state"], target=target, generation=row["generation"], actor="watchdog",
            reason=f"lease of {row['lease_owner'] or 'a worker'} expired: fenced; check the vendor before any retry",
            fields=dict(lease_owner="", lease_expires_at=None, due_at=now, enqueued_at=None, phase="", reconcile_rounds=0,
                        **({"error_code": "lease_expired"} if target == S.RECONCILING else {})),
            attempt_outcome=Attempt.Outcome.FENCED if row["state"] == S.RUNNING else None,
            data={"watchdog": seen},
        )
        if moved:
            fenced += 1
            slots_release(row["pk"], UPLOAD, reason="fenced")
            _kill_local_subprocess(attempt)
            _log_fence(row, seen, now, reason="lease_expired")
    overdue = Task.objects.filter(state=S.RUNNING, attempt_deadline_at__lt=now).values(*columns)[:BATCH]
    for row in overdue:
        attempt = Attempt.objects.filter(task_id=row["pk"], ended_at__isnull=True).order_by("-generation").first()
        seen = _holder(row, attempt)
        moved = task_move(
            row["pk"], source=S.RUNNING, target=S.RECONCILING, generation=row["generation"], actor="watchdog",
            reason="the attempt ran past its execution timeout: fenced; the vendor job will be checked and stopped",
            fields=dict(lease_owner="", lease_expires_at=None, due_at=now, enqueued_at=None, phase="",
                        error_code="execution_timeout", reconcile_rounds=0),
            attempt_outcome=Attempt.Outcome.FENCED,
            data={"watchdog": seen},
        )
        if moved:
            fenced += 1
            slots_release(row["pk"], UPLOAD, reason="execution timeout")
            _log_fence(row, seen, now, reason="execution_timeout")
    return fenced


def _holder(row: dict[str, Any], attempt: Attempt | None) -> dict[str, Any]:
    return {
        "owner": row["lease_owner"], "pid": attempt.pid if attempt else None, "host": attempt.host if attempt else None,
        "phase": row["phase"], "last_heartbeat": attempt.heartbeat_at.isoformat() if attempt and attempt.heartbeat_at else None,
    }


def _log_fence(row: dict[str, Any], seen: dict[str, Any], now: datetime, *, reason: str) -> None:
    started = row["started_at"]
    log_event("fenced", logging.WARNING, task_id=row["pk"], kind=row["kind"], state=row["state"], step=row["phase"] or None,
              reason=reason, pid=seen["pid"], host=seen["host"], submitted_at=row["created_at"].isoformat(),
              started_at=started.isoformat() if started else None,
              elapsed_s=round((now - started).total_seconds(), 3) if started else None)


def _kill_local_subprocess(attempt: Attempt | None) -> None:
    """A pre-check subprocess of a fenced attempt on this host is killed (see precheck.sandbox)."""
    kill_orphans()


# --- moving work forward ---------------------------------------------------------------------
def _retries_due(now: datetime) -> QuerySet:
    return Task.objects.filter(state=S.RETRY_WAIT, due_at__lte=now)


def promote_retries(now: datetime) -> int:
    promoted = 0
    rows = _retries_due(now).select_related("lane")[:BATCH]
    down: dict[str, bool] = {}
    for task in rows:
        if task.waiting_reason == "all_channels_down":
            if task.kind not in down:
                down[task.kind] = channels_down_for(task, channel_rooms())
            if down[task.kind]:
                # Still no channel up: keep waiting here (its queue deadline has not started).
                task_update(task.pk, state=S.RETRY_WAIT, generation=task.generation,
                            due_at=now + timedelta(seconds=outage_recheck_s()))
                continue
        moved = task_move(
            task.pk, source=S.RETRY_WAIT, target=S.QUEUED, generation=task.generation, actor=ACTOR,
            reason="retry due",
            fields=dict(queued_at=now, due_at=None, dispatched_at=None, enqueued_at=None,
                        queue_deadline_at=now + timescale.delta(task.lane.queue_deadline_s)),
        )
        promoted += bool(moved)
    return promoted


def outage_recheck_s() -> float:
    """Real seconds between looks at whether a channel is back, for work parked by an outage."""
    return timescale.seconds(min(RetryPolicy().cap_s, BreakerPolicy().open_wait_s))


def park_for_outage(task: Task, now: datetime) -> bool:
    """No channel that could take this task is up: it waits in RETRY_WAIT (all_channels_down)
    rather than running out its queue deadline in the lane."""
    moved = task_move(
        task.pk, source=S.QUEUED, target=S.RETRY_WAIT, generation=task.generation, actor=ACTOR,
        reason="every channel for this kind is down: waiting for one to recover",
        fields=dict(due_at=now + timedelta(seconds=outage_recheck_s()), waiting_reason="all_channels_down",
                    dispatched_at=None, enqueued_at=None),
        data={"waiting_reason": "all_channels_down"},
    )
    return moved is not None


def _waiting_for_admission(now: datetime | None = None) -> QuerySet:
    return Task.objects.filter(state=S.QUEUED, dispatched_at__isnull=True)


def admit_waiting(now: datetime) -> int:
    return sum(len(admit_lane(lane, now)) for lane in lanes_with_waiting_work())


def lanes_with_waiting_work() -> list[Lane]:
    """The unpaused lanes that have queued tasks not yet dispatched, in dispatch order: one
    statement, from the lanes' counter rows (what admission's own first look reads), whatever
    the backlog."""
    return select(Lane, f"t.paused = %s AND t.name IN ({counters.LANES_WITH_QUEUED}) ORDER BY t.dispatch_order",
                  [("paused", False)])


def _deferred(now: datetime | None = None) -> QuerySet:
    return Task.objects.filter(state=S.ACCEPTED, deferred=True)


def admit_deferred(now: datetime) -> int:
    """Tasks accepted while their lane was full (defer policy) enter it once there is room."""
    moved_count = 0
    waiting = set(_deferred().values_list("lane_id", flat=True).distinct())
    for lane in Lane.objects.filter(pk__in=waiting) if waiting else ():
        # The lane's counter rows, not a count of its backlog (which may be the flood that filled it).
        room = lane.max_queued - counters.lane_counts(lane.name)["queued"]
        if room <= 0:
            continue
        rows = Task.objects.filter(lane=lane, state=S.ACCEPTED, deferred=True).order_by("created_at").values(
            "pk", "generation"
        )[: min(room, BATCH)]
        for row in rows:
            if task_move(
                row["pk"], source=S.ACCEPTED, target=S.QUEUED, generation=row["generation"], actor=ACTOR,
                reason=f"lane {lane.name} has room again", fields=dict(queued_at=now, deferred=False),
            ):
                moved_count += 1
    return moved_count


def admit_lane(lane: Lane, now: datetime, *, starting_here: Any = None,
               looked: dict | None = None) -> list[tuple[Any, int, str]]:
    """Dispatch the lane's waiting tasks into free slots: fair share by tenant weight, with aging.

    `starting_here`: a task the calling worker will start itself if it is admitted (a pre-check
    that queued it on the lane's own cluster); no start message is sent for it. If that worker
    dies first, the start is presumed lost and sent by the dispatcher (resend_lost_starts).
    `looked`: the lane's `lane_slots_by_tenant` as the caller just read it, having queued a task
    since (the pre-check), so the lane has work and only its free slots are looked at here."""
    sent: list[tuple[Any, int, str]] = []
    # A cheap look first (one statement): most passes have nothing to admit or no free slot, and
    # the lock is a write lock on SQLite. Both are looked at again under the lock.
    standing = looked
    if standing is None:
        standing = lane_slots_by_tenant(lane)
        if not any(waiting for _, waiting in standing.values()):
            return sent
    if lane.max_running - sum(running for running, _ in standing.values()) <= 0:
        return sent
    with dispatch_lock():
        # The decision is made now, not when the caller began: a pass may have waited for the
        # lock while another admitted. Stamped with the earlier time, its tasks would read as
        # started before the other pass's, and their queue waits as shorter than they were.
        now = max(now, timezone.now())
        lane, standing, rooms = lane_with_slots_and_rooms(lane.pk)
        if lane is None or lane.paused:
            return []
        lane_read(lane.name, lane.execution_timeout_s)
        free = lane.max_running - sum(running for running, _ in standing.values())
        tenants = [t for t, (_, waiting) in standing.items() if waiting]
        if free <= 0 or not tenants:
            return []
        running_here = {t: running for t, (running, _) in standing.items()}
        limits = quotas.quotas_effective(tenants, now=now)
        # A tenant's running quota counts its tasks in every lane (asked only of tenants that have one).
        running_all = {t: quotas.tenant_running(t) for t in tenants if limits[t].max_running is not None}
        heads = _waiting_heads(lane, tenants, free)
        policy = AdmissionPolicy(aging_s=lane.aging_s, urgency_s=lane.urgency_s)
        while free > 0:
            firsts = {t: admission_head(heads[t][0], now) for t in tenants if heads[t]}
            shares = {
                t: Share(running=running_here.get(t, 0), weight=limits[t].weight(lane.name),
                         at_quota=limits[t].max_running is not None and running_all[t] >= limits[t].max_running)
                for t in firsts
            }
            tenant = policy.next_tenant(firsts, shares)
            if tenant is None:
                break
            task = heads[tenant].pop(0)
            room = pick_channel(task, rooms)
            if room is None:
                if channels_down_for(task, rooms):
                    park_for_outage(task, now)
                continue
            fields = _dispatch_fields(task, room, now)
            if not task_update(task.pk, state=S.QUEUED, generation=task.generation, **fields):
                continue
            slots_reserve(task, room.channel)
            room.take(lane.name)
            running_here[tenant] = running_here.get(tenant, 0) + 1
            if tenant in running_all:
                running_all[tenant] += 1
            free -= 1
            sent.append((task.pk, task.generation, lane.name))
        for task_id, generation, lane_name in sent:
            if str(task_id) != str(starting_here):
                transaction.on_commit(lambda t=task_id, g=generation, n=lane_name: send_step("start", t, g, lane=n))
    return sent


def _dispatch_fields(task: Task, room: ChannelRoom, now: datetime) -> dict[str, Any]:
    """What dispatching `task` onto `room`'s channel writes: the dispatch time and, for a new
    operation (a first one, or another channel's: a fallback, recorded), its client_ref and key."""
    fields: dict[str, Any] = dict(dispatched_at=now, enqueued_at=now)
    if task.channel_id != room.channel.name or not task.vendor_idempotency_key:
        fields.update(new_operation_fields(task, room.channel))
        if task.channel_id and task.channel_id != room.channel.name:
            lifecycle.record_event(
                task.pk, generation=task.generation, actor=ACTOR,
                reason=f"fallback: {task.channel_id} → {room.channel.name}",
                data={"from": task.channel_id, "to": room.channel.name},
            )
    return fields


@dataclass(frozen=True)
class Arrival:
    """What became of a pre-checked task queued into its lane (task_queue_on_arrival)."""

    outcome: str  # "deferred", "queued" (waits for a pass), "dispatched" (admitted as it arrived), "stale"
    lane: Lane
    standing: dict  # the lane's tenant → (holding a slot, waiting), this task included


def task_queue_on_arrival(task: Task, lane_name: str, *, estimated_units: int | None, actor: str,
                          data: dict[str, Any], starting_here: bool = False, writes: tuple[Write, ...] = ()) -> Arrival:
    """Move a pre-checked task ACCEPTED → QUEUED in its lane, under the admission lock, and admit
    it in the same move when nothing else waits there and a slot, its tenant's running quota and
    a channel have room (incremental admission: a pass over the lane would pick it, and reads the
    lane's waiting heads to learn so). Otherwise it waits for a pass, which the caller runs
    (admit_lane) when the lane has a free slot; a lane whose backlog is full defers it.

    `starting_here`: the calling worker runs the lane's steps, so an admitted task is also claimed
    for it in the same move (QUEUED, then RUNNING, each recorded) and no start message is sent.
    The in-memory `task` is left as the move wrote it (its lane, channel, operation and claim), so
    that the worker need not read it again. `writes`: what commits with the task's move or update
    here (its file's verdict), whatever came of it as each says (`rows.Write.if_moved`)."""
    with dispatch_lock():
        now = timezone.now()
        lane, standing, rooms = lane_with_slots_and_rooms(lane_name)
        lane_read(lane.name, lane.execution_timeout_s)
        waiting = sum(queued for _, queued in standing.values())
        if task.deferred or waiting >= lane.max_queued:
            task_update(task.pk, state=S.ACCEPTED, generation=task.generation, lane=lane, deferred=True,
                        estimated_units=estimated_units, due_at=None, lease_owner="", lease_expires_at=None,
                        writes=writes)
            return Arrival("deferred", lane, standing)
        task.lane = lane
        room = None
        free = lane.max_running - sum(running for running, _ in standing.values())
        if not lane.paused and free > 0 and waiting == 0:
            limit = quotas.quotas_effective([task.tenant_id], now=now)[task.tenant_id]
            at_quota = limit.max_running is not None and quotas.tenant_running(task.tenant_id) >= limit.max_running
            if AdmissionPolicy.admits_on_arrival(waiting=waiting, free=free, at_quota=at_quota):
                room = pick_channel(task, rooms)
        queue_deadline_at = task.created_at + timescale.delta(lane.queue_deadline_s)
        fields: dict[str, Any] = dict(
            lane=lane, queued_at=now, estimated_units=estimated_units, due_at=None, lease_owner="",
            lease_expires_at=None, waiting_reason="", queue_deadline_at=queue_deadline_at,
            dispatch_deadline_at=min(task.deadline_at, queue_deadline_at))
        claimed, then = {}, []
        if room is not None:
            fields.update(_dispatch_fields(task, room, now))
            if starting_here:
                task.channel, task.queued_at = room.channel, now
                claimed, hop = claim(task, now)
                then = [hop]
            # Its slots (and, claimed, its attempt) are written with the move.
            writes += (slots_reserved(task, room.channel),)
            if claimed:
                writes += (Write.insert([claim_attempt(task, task.generation + 2, claimed, now)]),)
        moved = lifecycle.transition(task.pk, source=S.ACCEPTED, target=S.QUEUED, generation=task.generation,
                                     actor=actor, reason=f"pre-check passed; lane {lane.name}", at=now, data=data,
                                     fields={**fields, **claimed, **({"attempts": F("attempts") + 1} if claimed else {})},
                                     then=then, writes=writes)
        if moved is None:
            return Arrival("stale", lane, standing)
        for name, value in {**fields, **claimed}.items():
            setattr(task, name, value)
        task.state, task.generation = (S.RUNNING if claimed else S.QUEUED), moved.generation
        running, queued = standing.get(task.tenant_id, (0, 0))
        if room is None:
            standing = {**standing, task.tenant_id: (running, queued + 1)}
            return Arrival("queued", lane, standing)
        if claimed:
            task.attempts += 1
        else:
            transaction.on_commit(lambda: send_step("start", task.pk, task.generation, lane=lane.name))
        return Arrival("dispatched", lane, {**standing, task.tenant_id: (running + 1, queued)})


def admission_head(task: Task, now: datetime) -> Head:
    """A queue's first task as admission weighs it (nominal seconds)."""
    deadline = min(d for d in (task.deadline_at, task.queue_deadline_at) if d is not None)
    waited = now - (task.queued_at or task.created_at)
    return Head(waited_s=timescale.nominal(waited.total_seconds()),
                deadline_in_s=timescale.nominal((deadline - now).total_seconds()))


def dispatch_soon(lane_name: str | None, *, starting_here: Any = None) -> None:
    """Event-driven admission (after intake, a finished step, a freed slot). Without a lane, every
    lane with waiting work, in dispatch order."""
    if lane_name:
        lanes = list(Lane.objects.filter(paused=False, pk=lane_name))
    else:
        lanes = lanes_with_waiting_work()
    for lane in lanes:
        admit_lane(lane, timezone.now(), starting_here=starting_here)


STEPS = {S.ACCEPTED: "precheck", S.RUNNING: "poll", S.RECONCILING: "reconcile", S.CANCEL_REQUESTED: "cancel"}
RUNNING_STEPS = {Task.Phase.POLL: "poll", Task.Phase.FETCH: "fetch"}


def _steps_due(now: datetime, *, resends: bool = False) -> QuerySet:
    """Tasks whose step is due and not held by a live lease: not yet sent since it fell due, or
    (`resends`) sent long enough ago that the message may have been lost."""
    unsent = Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=F("due_at"))
    return (
        Task.objects.filter(state__in=list(STEPS), due_at__lte=now)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
        .filter(unsent | Q(enqueued_at__lt=resend_cutoff(now)) if resends else unsent)
    )


def _steps_unheard(now: datetime) -> QuerySet:
    return _steps_due(now, resends=True)


def resend_due_steps(now: datetime) -> int:
    """The safety net for steps: a message sent for a due step that nobody took is sent again
    (looked for in full passes only: a message waiting behind a backlog is not lost)."""
    return send_due_steps(now, resends=True)


def send_due_steps(now: datetime, *, resends: bool = False) -> int:
    """Send the next step of every task whose step is due and not held by a live lease."""
    steps, running_steps = STEPS, RUNNING_STEPS
    rows = _steps_due(now, resends=resends).values(
        "pk", "state", "generation", "lane_id", "phase", "enqueued_at", "due_at")[:BATCH]
    sent = 0
    backlogs = Backlogs()
    for row in rows:
        if row["state"] == S.RUNNING and row["phase"] not in running_steps:
            continue
        resend = row["enqueued_at"] is not None and row["enqueued_at"] >= row["due_at"]
        if resend and not presumed_lost(row["enqueued_at"], now, row["lane_id"], backlogs):
            continue
        if task_update(row["pk"], state=row["state"], generation=row["generation"], enqueued_at=now):
            step = running_steps[row["phase"]] if row["state"] == S.RUNNING else steps[row["state"]]
            send_step(step, row["pk"], row["generation"], lane=row["lane_id"])
            sent += 1
    return sent


def _starts_unheard(now: datetime) -> QuerySet:
    return Task.objects.filter(state=S.QUEUED, dispatched_at__isnull=False, enqueued_at__lt=resend_cutoff(now))


def resend_lost_starts(now: datetime) -> int:
    """A start message lost between dispatcher and worker (at-most-once Redis) is sent again."""
    rows = _starts_unheard(now).values("pk", "generation", "lane_id", "enqueued_at")[:BATCH]
    sent = 0
    backlogs = Backlogs()
    for row in rows:
        if not presumed_lost(row["enqueued_at"], now, row["lane_id"], backlogs):
            continue
        if task_update(row["pk"], state=S.QUEUED, generation=row["generation"], enqueued_at=now):
            send_step("start", row["pk"], row["generation"], lane=row["lane_id"])
            sent += 1
    return sent


def _open_breakers(now: datetime) -> QuerySet:
    return ChannelHealth.objects.filter(breaker_state__in=(B.OPEN, B.HALF_OPEN))


def probe_open_breakers(now: datetime) -> int:
    """An OPEN breaker past its wait gets a probe call, so recovery is noticed without traffic; a
    HALF_OPEN one whose trial calls never reported is opened again first (they died with their
    worker: without this it would refuse every call for ever)."""
    for health in ChannelHealth.objects.filter(breaker_state=B.HALF_OPEN).select_related("channel"):
        breaker.reopen_if_trials_lost(health.channel, health)
    return _probe_open(now)


def _probe_open(now: datetime) -> int:
    """An OPEN breaker past its wait gets a probe call, so recovery is noticed without traffic."""
    sent = 0
    for health in ChannelHealth.objects.filter(breaker_state=B.OPEN).select_related("channel"):
        channel = health.channel
        if breaker.is_available(channel, health):
            send("tasks.workers.run_probe", channel.name, name=f"probe {channel.name}")
            sent += 1
    return sent


def _ledger_syncs_due(now: datetime) -> QuerySet:
    return ChannelHealth.objects.filter(ledger_sync_due_at__lte=now)


def send_due_ledger_syncs(now: datetime) -> int:
    """A ledger sync that could not finish is tried again when it said it would."""
    sent = 0
    for channel_id in ChannelHealth.objects.filter(ledger_sync_due_at__lte=now).values_list("channel_id", flat=True):
        if ChannelHealth.objects.filter(pk=channel_id, ledger_sync_due_at__lte=now).update(ledger_sync_due_at=None):
            send("tasks.workers.run_ledger_sync", channel_id, name=f"ledger sync {channel_id}")
            sent += 1
    return sent


def _notifications_due(now: datetime) -> QuerySet:
    return Notification.objects.filter(
        Q(status=Notification.Status.DELIVERING, lease_expires_at__lt=now)
        | Q(status=Notification.Status.PENDING, next_attempt_at__lte=now)
    )


def send_due_notifications(now: datetime) -> int:
    resend_before = resend_cutoff(now)
    # A delivery whose worker died mid-send goes back to pending.
    Notification.objects.filter(status=Notification.Status.DELIVERING, lease_expires_at__lt=now).update(
        status=Notification.Status.PENDING, lease_expires_at=None
    )
    rows = Notification.objects.filter(status=Notification.Status.PENDING, next_attempt_at__lte=now).filter(
        Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=resend_before) | Q(enqueued_at__lt=F("next_attempt_at"))
    ).values_list("pk", flat=True)[:BATCH]
    sent = 0
    for pk in rows:
        if Notification.objects.filter(pk=pk, status=Notification.Status.PENDING).update(enqueued_at=now):
            send("tasks.workers.run_notification", pk, name=f"notify {pk}")
            sent += 1
    return sent


def _billing_audits_due(now: datetime) -> QuerySet:
    return Task.objects.filter(billing_audit_due_at__lte=now)


def send_due_billing_audits(now: datetime) -> int:
    """Duplicate audits due again (one that could not list the jobs, the follow-up after an
    ambiguous create). Sending one moves it a resend window on, so a lost message is sent again."""
    later = now + (now - resend_cutoff(now))
    sent = 0
    for pk in Task.objects.filter(billing_audit_due_at__lte=now).values_list("pk", flat=True)[:BATCH]:
        if Task.objects.filter(pk=pk, billing_audit_due_at__lte=now).update(billing_audit_due_at=later):
            send("tasks.workers.run_billing_audit", str(pk), name=f"billing audit {pk}")
            sent += 1
    return sent


def _vendor_jobs_to_clean(now: datetime) -> QuerySet:
    return VendorJob.objects.filter(terminal_at__isnull=True).filter(
        Q(task__state__in=TERMINAL_STATES) | Q(duplicate_of__isnull=False) | Q(cancel_requested_at__isnull=False))


def clean_up_vendor_jobs(now: datetime) -> int:
    """Live vendor jobs nobody tracks any more (duplicates, jobs of finished tasks) are cancelled."""
    grace = now - timedelta(seconds=max(timescale.seconds(settings.LEASE_S) * 2, settings.LEASE_FLOOR_S * 2))
    marked = VendorJob.objects.filter(
        Q(task__state__in=TERMINAL_STATES) | Q(duplicate_of__isnull=False),
        terminal_at__isnull=True, cancel_requested_at__isnull=True, created_at__lt=grace,
    ).update(cancel_requested_at=now)
    resend_before = resend_cutoff(now)
    due = VendorJob.objects.filter(terminal_at__isnull=True, cancel_requested_at__isnull=False).filter(
        Q(cleanup_sent_at__isnull=True) | Q(cleanup_sent_at__lt=resend_before)
    ).values_list("pk", flat=True)[:BATCH]
    sent = 0
    for pk in due:
        if VendorJob.objects.filter(pk=pk).update(cleanup_sent_at=now):
            send("tasks.workers.run_vendor_job_cleanup", pk, name=f"vendor job {pk}")
            sent += 1
    return marked + sent


# --- why is this task waiting? -----------------------------------------------------------------


# What a short pass and a full pass do, in order: (is there anything to do?, do it).
_SHORT_PASSES = {
    "retries_due": (_retries_due, promote_retries),
    "undeferred": (_deferred, admit_deferred),
    "admitted": (_waiting_for_admission, admit_waiting),
    "steps_sent": (_steps_due, send_due_steps),
}
_FULL_PASSES = {
    "expired": (_past_queue_deadline, expire_queue_deadlines),
    "deadline_failed": (_past_business_deadline, enforce_business_deadlines),
    "fenced": (_fenceable, watchdog),
    **_SHORT_PASSES,
    "steps_resent": (_steps_unheard, resend_due_steps),
    "starts_resent": (_starts_unheard, resend_lost_starts),
    "probes": (_open_breakers, probe_open_breakers),
    "ledger_syncs": (_ledger_syncs_due, send_due_ledger_syncs),
    "notifications": (_notifications_due, send_due_notifications),
    "vendor_jobs": (_vendor_jobs_to_clean, clean_up_vendor_jobs),
    "billing_audits": (_billing_audits_due, send_due_billing_audits),
}


def _waiting_heads(lane: Lane, tenants: list[Any], count: int) -> dict[Any, list[Task]]:
    """Each tenant's first `count` tasks waiting in the lane, the earliest dispatch deadline first
    (none last), then the longest waiting: one statement for one tenant, one a tenant otherwise."""
    where = ("t.lane_id = %s AND t.state = %s AND t.dispatched_at IS NULL{tenant} "
             "ORDER BY (t.dispatch_deadline_at IS NULL), t.dispatch_deadline_at, t.queued_at, t.created_at LIMIT %s")
    if len(tenants) == 1:
        return {tenants[0]: select(Task, where.format(tenant=""), [("lane", lane.pk), (None, S.QUEUED.value), (None, count)])}
    return {t: select(Task, where.format(tenant=" AND t.tenant_id = %s"),
                      [("lane", lane.pk), (None, S.QUEUED.value), ("tenant", t), (None, count)]) for t in tenants}
