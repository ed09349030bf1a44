"""Accepting work: immutable file versions, and tasks that are durable before anyone hears 202.

The task row is written (state ACCEPTED, with its Idempotency-Key and the fingerprint of the
request) in one transaction with its history entry; the message that triggers its pre-check goes
out after commit. If that
message is lost, the dispatcher finds the ACCEPTED task and sends it again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, router, transaction
from django.utils import timezone
from django_q.signals import pre_enqueue

from tasks import costs, counters, filetypes, lifecycle, locks, timescale
from tasks.errors import (
    BacklogFull,
    FileNotFound,
    FileQuarantined,
    IdempotencyKeyInUse,
    IdempotencyKeyMismatch,
    InvalidRequest,
    SluiceError,
    UnsupportedType,
)
from tasks.groupcommit import GroupCommit
from tasks.models import FileVersion, Lane, Quarantine, Task, TaskEvent, Tenant
from tasks.observability import log_event
from tasks.precheck import DETECTOR_VERSION
from tasks.queueing import messages_rung, send_steps_on_commit, step_rows
from tasks.rows import (
    Write,
    insert_together,
    json_rows,
    json_rows_sql,
    moment,
    new_row,
    planned_for_its_values,
    prepared_insert,
    select,
)
from tasks.scheduling.admission import LaneLoad, admission_gate
from tasks.scheduling.lanes import ROUTING
from tasks.scheduling.quotas import EffectiveQuota, QuotaUsage, counts_submissions, quota_effective
from tasks.services.dispatch import admit_lane, task_queue_on_arrival
from tasks.services.execution import Lease
from tasks.services.notifications import callback_url_validate
from tasks.services.outcomes import task_move
from tasks.services.quarantine import (
    content_entries,
    content_has_entries,
    file_precheck_with,
    poison_binding,
    released_from_poison,
)
from tasks.states import State
from tasks.storage import delete_stored, store_stream

PRIORITIES = ("interactive", "batch")
DEFAULT_DEADLINE_S = 24 * 3600
MAX_DEADLINE_S = 30 * 24 * 3600
MAX_PARAMS_BYTES = 4096


@dataclass(frozen=True)
class SubmitRequest:
    file_id: str
    kind: str
    target_format: str
    params: dict[str, Any] = field(default_factory=dict)
    priority: str = "batch"
    deadline_s: float | None = None
    callback_url: str = ""

    def fingerprint(self) -> str:
        """Everything that changes what the task does or where it reports: a key reused with any
        of it different is a mismatch (422), never a replay that drops the new values."""
        canonical = json.dumps(
            [self.file_id, self.kind, self.target_format, self.params, self.priority, self.deadline_s, self.callback_url],
            sort_keys=True, separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Submitted:
    task: Task
    replayed: bool


def file_create(*, tenant: Tenant, chunks: Iterable[bytes], label: str = "") -> FileVersion:
    """Stream an upload to disk and record an immutable file version."""
    blob = store_stream(chunks, max_bytes=int(settings.MAX_UPLOAD_BYTES))
    sniffed = filetypes.sniff(blob.head)
    if sniffed.family not in filetypes.ACCEPTED_AT_UPLOAD:
        delete_stored(blob.storage_name)
        raise UnsupportedType(
            f"Files of type {sniffed.mime} are not processed. Send audio (WAV, MP3, FLAC, OGG, M4A) or documents (PDF, Office, text)."
        )
    version = FileVersion.objects.create(
        tenant=tenant, sha256=blob.sha256, size=blob.size, detected_type=sniffed.mime,
        extension=filetypes.extension_of(label), label=label[:255], storage_name=blob.storage_name,
    )
    # An engine's poison verdict of an earlier engine version does not hold either (it is lifted
    # by poison_reevaluate; until then it is not applied).
    known = next((entry for entry in Quarantine.objects.filter(
        tenant=tenant, sha256=blob.sha256, released_at__isnull=True, purged_at__isnull=True,
        detector_version=DETECTOR_VERSION,
    ) if poison_binding(entry)), None)
    if known is not None:
        # The same content was quarantined by this version of the pre-check: recognised at once.
        # An entry of an older detector does not block it: the new upload is pre-checked again.
        FileVersion.objects.filter(pk=version.pk).update(
            precheck_state=FileVersion.Precheck.QUARANTINED,
            precheck_findings={**known.findings, "recognised_from": str(known.file_id)},
            precheck_version=known.detector_version, prechecked_at=timezone.now(),
        )
        version.refresh_from_db()
    log_event("file_stored", tenant_id=tenant.pk, file_id=version.pk, size=blob.size, detected_type=sniffed.mime)
    return version


def validate_submission(data: Any) -> SubmitRequest:
    """Parse a submission; InvalidRequest says exactly what to fix."""
    if not isinstance(data, dict):
        raise InvalidRequest("The body must be a JSON object.")
    unknown = set(data) - {"file_id", "kind", "target_format", "params", "priority", "deadline_s", "callback_url"}
    if unknown:
        raise InvalidRequest(f"Unknown field(s): {', '.join(sorted(unknown))}.", field=sorted(unknown)[0])
    file_id = data.get("file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("file_id is required: the id returned by POST /api/v1/files.", field="file_id")
    kind = data.get("kind")
    if kind not in filetypes.KINDS:
        raise InvalidRequest(f"kind must be one of: {', '.join(filetypes.KINDS)}.", field="kind")
    target = data.get("target_format")
    allowed = filetypes.TARGET_FORMATS[kind]
    if target not in allowed:
        raise InvalidRequest(f"target_format for {kind} must be one of: {', '.join(allowed)}.", field="target_format")
    params = data.get("params", {}) or {}
    if not isinstance(params, dict):
        raise InvalidRequest("params must be a JSON object.", field="params")
    if len(json.dumps(params)) > MAX_PARAMS_BYTES:
        raise InvalidRequest(f"params must be at most {MAX_PARAMS_BYTES} bytes of JSON.", field="params")
    priority = data.get("priority", "batch")
    if priority not in PRIORITIES:
        raise InvalidRequest(f"priority must be one of: {', '.join(PRIORITIES)}.", field="priority")
    deadline = data.get("deadline_s")
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 60 <= deadline <= MAX_DEADLINE_S
    ):
        raise InvalidRequest(f"deadline_s must be a number of seconds between 60 and {MAX_DEADLINE_S}.", field="deadline_s")
    callback = data.get("callback_url") or ""
    if not isinstance(callback, str):
        raise InvalidRequest("callback_url must be a string.", field="callback_url")
    if callback:
        callback_url_validate(callback)
    return SubmitRequest(
        file_id=file_id, kind=kind, target_format=target, params=params, priority=priority,
        deadline_s=float(deadline) if deadline is not None else None, callback_url=callback,
    )


def task_submit(*, tenant: Tenant, request: SubmitRequest, idempotency_key: str | None, actor: str) -> Submitted:
    """Accept a task durably, or raise an error that stored nothing.

    One write transaction: the task (with its key) and its history entry, and (ORM broker) its
    pre-check message commit together or not at all. Submissions of one tenant and priority that
    arrive in this process while one of theirs is being written share the next transaction (a
    group commit: each decided on its own, in arrival order, as a batch's items are). A second
    request with the same key while the first is still being accepted is refused (409) instead of
    waiting for it (PostgreSQL; on SQLite the first has committed before the second can look, and
    the second replays it). On PostgreSQL a submission whose decision is taken again (its lane
    filled while it was decided) lets its key go for that instant: a request with the key that
    comes then holds it, and this one is answered as that one's duplicate."""
    if transaction.get_connection().in_atomic_block:  # the caller's transaction: alone, inside it
        outcome = _submit_all(tenant=tenant, items=[(request, idempotency_key)], actor=actor)[0]
    else:
        outcome = _submissions.call((tenant.pk, actor, request.priority), (tenant, actor),
                                    (request, idempotency_key), exclusive=idempotency_key)
    if outcome.error is not None:
        raise outcome.error
    return outcome.submitted


@dataclass(frozen=True)
class BatchOutcome:
    submitted: Submitted | None = None
    error: SluiceError | None = None


def _submit_group(context: tuple[Tenant, str], items: list[tuple[SubmitRequest, str | None]]) -> list[BatchOutcome]:
    tenant, actor = context
    return _submit_all(tenant=tenant, items=items, actor=actor)


# Grouped by tenant, actor and priority: an interactive submission never waits behind a group
# bound for the batch lanes.
_submissions: GroupCommit[tuple[SubmitRequest, str | None], BatchOutcome] = GroupCommit(
    _submit_group, max_items=100)


def task_submit_batch(*, tenant: Tenant, items: list[tuple[SubmitRequest | SluiceError, str | None]],
                      actor: str) -> list[BatchOutcome]:
    """Many submissions from one request: each is accepted, replayed or refused on its own, as a
    single submission would be (one refusal stops nothing else, and a refused one leaves
    nothing), all of them committed together before the answer (durable before it, one commit for
    the batch instead of one per submission). Other submissions to the lanes it admits into wait
    for its admission decision and its commit, as they wait for each other (on PostgreSQL, for a
    tenant without counted quotas, only for the check of its decision and the commit)."""
    return _submit_all(tenant=tenant, items=items, actor=actor)


@dataclass
class _Item:
    index: int
    request: SubmitRequest
    key: str | None
    fingerprint: str


class _GateClosed(Exception):
    """An unlocked read found a lane's gate not open: the decision is taken again under its lock."""


class _Stale(Exception):
    """A tentative decision that the read under the gates' locks would not take: its transaction
    (inside a caller's, its savepoint) is rolled back, and the decision taken again under the
    locks. `reason`: what changed between the two reads (`key_taken`, `gate_closed`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Lanes:
    """The lanes a request admits into and their load, read once; every submission accepted into
    one is counted into its load. `tentative` loads were read without the gates' locks: a gate
    that is not open there is not acted on (no refusal, no shed, no deferral) but raises
    _GateClosed, so that the caller decides again under the locks."""

    def __init__(self, names: list[str], *, tentative: bool = False,
                 holders_of: tuple[Tenant, list[str]] | None = None) -> None:
        """`holders_of`: the tasks already holding these keys of the tenant are read in the same
        statement (`holders`), as _tasks_by_key reads them."""
        self.tentative = tentative
        also = _holders_column(*holders_of, first_lane=names[0]) if holders_of and names else None
        with _keys_read(holders_of[1] if holders_of else []):
            self.lanes = counters.lanes_with_load(names, also=also) if names else {}
        # None if not read (no keys, or no row for the first lane to carry them)
        self.holders = _holders(self.lanes[names[0]].key_holders) if also and names[0] in self.lanes else None
        self.loads = {name: {"waiting": lane.waiting_now, "running": lane.running_now, "oldest": lane.oldest_waiting_at}
                      for name, lane in self.lanes.items()}

    def key_holders(self, tenant: Tenant, keys: list[str]) -> dict[str, Task]:
        """The tasks holding these keys: as read with the lanes, or read now (not read with them)."""
        return self.holders if self.holders is not None else _tasks_by_key(tenant, keys)

    def load(self, lane: Lane) -> LaneLoad:
        counts = self.loads[lane.pk]
        oldest = counts["oldest"]
        return LaneLoad(waiting=counts["waiting"], running=counts["running"],
                        oldest_wait_s=timescale.nominal((timezone.now() - oldest).total_seconds()) if oldest else 0.0)

    def accepted(self, lane: Lane, now) -> None:
        counts = self.loads[lane.pk]
        counts["waiting"] += 1
        counts["oldest"] = counts["oldest"] or now

    def shed(self, lane: Lane) -> None:
        # One waiting task fewer. The oldest wait is kept as it was (this request's own tasks are
        # not written yet, a new read would miss them): the gate errs on the side of closing.
        self.loads[lane.pk]["waiting"] -= 1

    def still_open(self, accepted: list[Task], decided_at, *, written: bool = True) -> bool:
        """Whether every one of these tasks, counted in one by one, finds its lane's gate open in
        these loads (read under the gates' locks after a tentative decision). `written`: read
        with these tasks' rows written (PostgreSQL): a lane's oldest waiting task read as one of
        them, stamped `decided_at` before the wait for the lock, is counted as arriving now, as in
        a decision taken under the lock. Not written (SQLite, decided ahead), the oldest read is
        another request's and stands."""
        for counts in self.loads.values() if written else ():
            if counts["oldest"] is not None and counts["oldest"] >= decided_at:
                counts["oldest"] = None
        now = timezone.now()
        for task in accepted:
            lane = self.lanes[task.lane_id]
            if _gate(lane, self.load(lane)).state != "open":
                return False
            self.accepted(lane, now)
        return True


@dataclass
class _Decided:
    outcomes: list[BatchOutcome | None]
    accepted: list[tuple[_Item, Task, TaskEvent]]
    replayed: dict[int, Any]  # item index -> task id (or the earlier item of this request with its key)
    expired: list[Any] = field(default_factory=list)  # tasks whose keys the new tasks take over


def _submit_all(*, tenant: Tenant, items: list[tuple[SubmitRequest | SluiceError, str | None]],
                actor: str) -> list[BatchOutcome]:
    outcomes: list[BatchOutcome | None] = [None] * len(items)
    work: list[_Item] = []
    for index, (request, key) in enumerate(items):
        if isinstance(request, SluiceError):
            outcomes[index] = BatchOutcome(error=request)
        elif key is not None and not 1 <= len(key) <= 255:
            outcomes[index] = BatchOutcome(error=InvalidRequest("Idempotency-Key must be 1 to 255 characters."))
        else:
            work.append(_Item(index, request, key, request.fingerprint()))
    if not work:
        return outcomes  # type: ignore[return-value]
    quota = quota_effective(tenant)
    keys = [("idempotency-key", tenant.pk, item.key) for item in work if item.key]
    # PostgreSQL, no counted quota: decide on an unlocked read and write the rows, then take the
    # lanes' gate locks and check the decision against a fresh read; only that check and the
    # commit run under the locks (they are held to the commit, so that the next submission's read
    # counts this one). A decision the fresh read would not take is rolled back, the whole
    # transaction (rare: no savepoint is paid for on every submission; inside a caller's
    # transaction, its savepoint), and taken again under the locks: its keys' locks, let go with
    # it, are tried again first, and a request that took one meanwhile has it (this one is then
    # answered as that request's duplicate). The files are read in the transaction there, in the
    # statement that tries the keys' locks. Elsewhere they are read before it (not counts: nothing
    # to serialise), and the decision is taken under the locks (SQLite's one writer serialises the
    # whole transaction).
    unlocked = not counts_submissions(quota) and locks.are_real()
    read_before = None if unlocked else _files_of(tenant, work)[0]

    def decided_and_written(first_try: bool) -> _Decided:
        with transaction.atomic():
            files, taken = _files_of(tenant, work, try_keys=keys) if unlocked else (read_before, None)
            lane_names = sorted({_lane_for(files[i.index], i.request.priority) for i in work if files[i.index] is not None})
            held = [("tenant-quota", tenant.pk)] if counts_submissions(quota) else []
            held += [("lane-gate", name) for name in lane_names]  # always in this order: two requests never wait for each other
            tentative = unlocked and first_try and bool(lane_names)
            if unlocked:
                if not tentative and (len(keys) < len(work) or any(taken)):
                    locks.hold(*held)  # (not when every item's key is another request's: refused at once)
            elif len(work) == 1 and keys:
                # A key another request is accepting is refused at once, without waiting for its lane.
                taken = [locks.hold(*held, unless_taken=keys[0])]
            else:
                taken = locks.try_each(keys)
                locks.hold(*held)
            key_taken = dict(zip((k[2] for k in keys), taken or [], strict=True))
            # The lanes' load is read with the tasks holding the request's keys, in one statement
            # (under the gates' locks, or unlocked for a tentative decision, as the lanes are read).
            first = _Lanes(lane_names, tentative=tentative, holders_of=(tenant, list(key_taken)) if key_taken else None)
            used = first.key_holders(tenant, list(key_taken))
            now = timezone.now()

            def decide(lanes: _Lanes, at) -> _Decided:
                usage = QuotaUsage.read(tenant, quota, now=at) if counts_submissions(quota) else None
                return _decide(tenant=tenant, work=work, outcomes=list(outcomes), files=files, key_taken=key_taken,
                               used=used, quota=quota, usage=usage, lanes=lanes, actor=actor, now=at)

            if tentative:
                try:
                    decided = decide(first, now)
                except _GateClosed:
                    # Taken under the locks, it is taken now: after a long wait for them, the stamp
                    # read before would make this request's own tasks look long overdue to its gate.
                    locks.hold(*held)
                    decided = decide(_Lanes(lane_names), timezone.now())
                    tentative = False
            else:
                decided = decide(first, now)
            steps = [(task.pk, 0, task.lane_id) for _, task, _ in decided.accepted]
            carried = _write(decided, steps)
            if tentative and decided.accepted:
                locks.hold(*held)
                if not _Lanes(lane_names).still_open([task for _, task, _ in decided.accepted], now):
                    raise _Stale("gate_closed")
                _decided_before_the_lock()
            # Pre-checks run on the workers of the task's provisional lane: a batch flood's
            # pre-checks never queue in front of an interactive task's.
            if not carried:
                send_steps_on_commit("precheck", steps)
            return decided

    # SQLite, several submissions: decided and their rows built before the write transaction,
    # which holds the one writer's lock of the whole database only to check the decision and
    # write them. (Not one or two: their building is short, and the lanes' second read would be
    # a statement more for each task; measured, a single submission gained nothing.)
    ahead = None if unlocked or counts_submissions(quota) else _decided_ahead(
        tenant=tenant, work=work, outcomes=outcomes, files=read_before, quota=quota, actor=actor)
    if ahead is not None:
        decided = ahead
    else:
        try:
            decided = decided_and_written(True)
        except _Stale as stale:
            _decided_again(tenant, work, stale)
            decided = decided_and_written(False)  # its keys' locks were let go with it: tried again first
    outcomes, accepted, replayed = decided.outcomes, decided.accepted, decided.replayed
    tasks_by_index = {item.index: task for item, task, _ in accepted}
    stored_ids = [source for source in replayed.values() if not isinstance(source, _Item)]
    stored = {t.pk: t for t in Task.objects.filter(pk__in=stored_ids)} if stored_ids else {}
    for index, source in replayed.items():  # keys already used: by an earlier request first, then in this one
        if not isinstance(source, _Item):
            tasks_by_index[index] = stored[source]
    for index, source in replayed.items():
        if isinstance(source, _Item):
            tasks_by_index[index] = tasks_by_index[source.index]
        outcomes[index] = BatchOutcome(submitted=Submitted(task=tasks_by_index[index], replayed=True))
    for item, task, _ in accepted:
        outcomes[item.index] = BatchOutcome(submitted=Submitted(task=task, replayed=False))
        log_event("task_accepted", task_id=task.pk, tenant_id=tenant.pk, lane=task.lane_id, kind=item.request.kind,
                  size=task.file.size)
    return outcomes  # type: ignore[return-value]


def _decided_ahead(*, tenant: Tenant, work: list[_Item], outcomes: list[BatchOutcome | None], files: dict,
                   quota: EffectiveQuota, actor: str) -> _Decided | None:
    """SQLite, several submissions (a batch, or a group commit of ROWS_OF_THEIR_OWN or more) of a
    tenant whose submissions no quota counts, outside a caller's transaction: the
    submissions decided on a read of their lanes and keys taken before the write transaction,
    and their rows, notes and messages built then too. The transaction, which holds the lock of
    the database's one writer (every other write of every process waits for it), reads the
    lanes and keys again and writes the rows only if that read takes the same decision: no task
    holds a key now that did not then, and each accepted task finds its lane's gate open, counted
    in one by one (as under the lock). None when the decision is not one to take ahead (a gate
    not open, a key past its time, nothing to write) or the second read would not take it: the
    caller then decides under the lock, as before."""
    alias = router.db_for_write(Task)
    if connections[alias].vendor != "sqlite" or connections[alias].in_atomic_block or len(work) < ROWS_OF_THEIR_OWN:
        return None
    if pre_enqueue.has_listeners():
        return None  # (they would hear of messages a decision taken again drops)
    lane_names = sorted({_lane_for(files[i.index], i.request.priority) for i in work if files[i.index] is not None})
    if not lane_names:
        return None
    keys = sorted({item.key for item in work if item.key})
    holders_of = (tenant, keys) if keys else None
    lanes = _Lanes(lane_names, tentative=True, holders_of=holders_of)
    used = lanes.key_holders(tenant, keys)
    now = timezone.now()
    try:
        decided = _decide(tenant=tenant, work=work, outcomes=list(outcomes), files=files,
                          key_taken=dict.fromkeys(keys, True), used=used, quota=quota, usage=None,
                          lanes=lanes, actor=actor, now=now)
    except _GateClosed:
        return None
    if decided.expired or not decided.accepted:
        return None
    steps = [(task.pk, 0, task.lane_id) for _, task, _ in decided.accepted]
    write, carried = _prepared_write(decided, steps, ahead=True)
    try:
        with transaction.atomic(using=alias):
            again = _Lanes(lane_names, holders_of=holders_of)
            held = again.key_holders(tenant, keys)
            if {key: task.pk for key, task in held.items()} != {key: task.pk for key, task in used.items()}:
                raise _Stale("key_taken")
            if not again.still_open([task for _, task, _ in decided.accepted], now, written=False):
                raise _Stale("gate_closed")
            write()
            if not carried:
                send_steps_on_commit("precheck", steps)
    except _Stale as stale:
        _decided_again(tenant, work, stale)
        return None
    _decided_before_the_lock()
    return decided


def _decided_before_the_lock() -> None:
    """A decision taken before the lock and written as taken (counted for the benchmark, which
    reports the share of such decisions taken again)."""
    costs.count("intake:ahead")


def _decided_again(tenant: Tenant, work: list[_Item], stale: _Stale) -> None:
    """A decision taken before the lock that the read under it would not take: thrown away and
    taken again under the lock. Said, with why (`key_taken`: another request took one of its
    keys meanwhile; `gate_closed`: a lane filled meanwhile), so that an operator sees how often
    the work done ahead is lost under their load."""
    costs.count("intake:again")
    log_event("intake_decided_again", tenant_id=tenant.pk, reason=stale.reason, count=len(work))


def _decide(*, tenant: Tenant, work: list[_Item], outcomes: list[BatchOutcome | None], files: dict,
            key_taken: dict[str, bool], used: dict[str, Task], quota: EffectiveQuota, usage: QuotaUsage | None,
            lanes: _Lanes, actor: str, now) -> _Decided:
    """Each item accepted (its unsaved rows), replayed or refused, in the request's order."""
    accepted: list[tuple[_Item, Task, TaskEvent]] = []
    first_with: dict[str, _Item] = {}  # a key's first item in this request that was accepted or replayed
    replayed: dict[int, Any] = {}
    expired: list[Any] = []  # tasks whose keys are past their time, to forget before the new ones
    used = dict(used)
    for item in work:
        try:
            if item.key:
                if not key_taken[item.key]:
                    raise IdempotencyKeyInUse(retry_after=1)
                earlier = first_with.get(item.key)
                holder = used.get(item.key)
                if holder is not None and holder.created_at < key_kept_since(now):
                    expired.append(holder.pk)  # kept past its time: the key makes a new task
                    used.pop(item.key)
                    holder = None
                # (A task that holds the key with no fingerprint anywhere is replayed: only a
                # process of the release before 0025, in the overlap of a deploy, leaves one.)
                known = holder.key_fingerprint if holder is not None else None
                fingerprint = earlier.fingerprint if earlier else (known or item.fingerprint)
                if fingerprint != item.fingerprint:
                    raise IdempotencyKeyMismatch()
                if earlier is not None:
                    replayed[item.index] = earlier
                    continue
                if holder is not None:
                    replayed[item.index] = holder.pk
                    first_with[item.key] = item
                    continue
            task, event = _admit_one(tenant=tenant, item=item, file=files[item.index], quota=quota,
                                     usage=usage, lanes=lanes, actor=actor, now=now)
        except SluiceError as error:
            outcomes[item.index] = BatchOutcome(error=error)
            continue
        accepted.append((item, task, event))
        if item.key:
            first_with[item.key] = item
    return _Decided(outcomes=outcomes, accepted=accepted, replayed=replayed, expired=expired)


def _write(decided: _Decided, steps: list[tuple[Any, int, str | None]]) -> bool:
    """The accepted submissions' rows: the tasks (with their keys) and their first history
    entries; a key past its time is forgotten by the task that held it first (as the prune does).
    On SQLite the pre-check's messages are written with them when the broker is embedded
    (`steps`, in the accepted's order): a few tasks' INSERTs carry their entry and message in
    their notes, more write them as a statement each (ROWS_OF_THEIR_OWN). Whether the messages
    were written here."""
    write, carried = _prepared_write(decided, steps)
    write()
    return carried


def _prepared_write(decided: _Decided, steps: list[tuple[Any, int, str | None]], *, ahead: bool = False
                    ) -> tuple[Callable[[], None], bool]:
    """`_write` made ready: on SQLite its statements built (their values, the notes and the
    messages' packages), to be run when the first element is called (`ahead`: made before the
    transaction that runs it begins); and whether it writes the messages."""
    accepted = decided.accepted
    expired = decided.expired
    # Written lane by lane: on PostgreSQL the counter rows are locked at commit in this order,
    # the order every other writer uses (tasks/counters.py).
    tasks = sorted((task for _, task, _ in accepted), key=lambda task: task.lane_id or "")
    if connections[router.db_for_write(Task)].vendor != "sqlite":
        def together() -> None:
            if expired:
                forget_keys(expired)
            insert_together(tasks, [event for _, _, event in accepted])  # (in one statement on PostgreSQL)
        return together, False
    messages = step_rows("precheck", steps, ahead=ahead)
    if len(accepted) >= ROWS_OF_THEIR_OWN:
        # Several: the entries in one statement of their own and the messages in another, as the
        # tasks are (a note parsed by the trigger for each row costs more than the rows it writes).
        inserts = [prepared_insert(tasks), prepared_insert([event for _, _, event in accepted]),
                   prepared_insert(messages or [])]
        rest: list[Write] = []
    else:
        rest = []
        for n, (_, task, event) in enumerate(accepted):
            rest += lifecycle.inserted_with(task, [event], (Write.insert([messages[n]]),) if messages else ())
        inserts = [prepared_insert(tasks)]

    def statements() -> None:
        if expired:
            forget_keys(expired)
        for insert in inserts:
            insert()
        for write in rest:
            write.run()
        if ahead and messages:
            messages_rung(messages)
    return statements, messages is not None


# From this many accepted submissions in one write on SQLite, their history entries and messages
# are written as statements of their own instead of in each task's INSERT: a task's INSERT whose
# note the trigger parses took about 0.34 ms of the database's time, 0.06 without a note, and an
# entry or a message 0.01–0.02 ms in a statement of many rows (docs/performance.md, 2026-12-07).
# One task alone: its INSERT and commit took 0.50 ms with its note against 0.41 ms as three
# statements on the database alone, and each statement adds its own way through Django: about
# even, and the note is two statements a task fewer.
ROWS_OF_THEIR_OWN = 3


# An Idempotency-Key is kept this long (nominal seconds) from its task's acceptance, and never
# less than a day of real time; then it is forgotten, and makes a new task.
IDEMPOTENCY_KEEP_S = 48 * 3600


def key_kept_since(now):
    """Keys of tasks accepted before this moment are past their time."""
    return now - timedelta(seconds=max(timescale.seconds(IDEMPOTENCY_KEEP_S), 24 * 3600))


def forget_keys(task_ids: list[Any]) -> int:
    """These tasks forget their Idempotency-Keys (unique per tenant: kept, a key would refuse its
    next use) and their requests' fingerprints."""
    return Task.objects.filter(pk__in=task_ids, idempotency_key__isnull=False).update(
        idempotency_key=None, idempotency_fingerprint=None)


def _tasks_by_key(tenant: Tenant, keys: list[str]) -> dict[str, Task]:
    """The tasks that already hold these keys, with the fingerprint of the request that made each
    (`key_fingerprint`; a task a process of the release before migration 0025 accepted has it in
    the key's record only)."""
    if not keys:
        return {}
    connection = connections[router.db_for_read(Task)]
    where, params = _holding(connection, "t", tenant, keys)
    with _keys_read(keys):
        found = select(Task, where, [(None, value) for value in params],
                       only=("idempotency_key", "created_at"), extra={"key_fingerprint": _key_fingerprint("t")})
    return {task.idempotency_key: task for task in found}


def _holding(connection, alias: str, tenant: Tenant, keys: list[str]) -> tuple[str, list]:
    """The condition on the task rows aliased `alias` that hold one of these keys of the tenant,
    and its parameters."""
    tenant_id = Task._meta.get_field("tenant").get_db_prep_value(tenant.pk, connection)
    if connection.vendor == "postgresql" and len(keys) > 1:
        return _holding_sql(connection.vendor, alias, 0), [list(keys), tenant_id]
    return _holding_sql(connection.vendor, alias, len(keys)), [tenant_id, *keys]


def _keys_read(keys: list[str]):
    """Around a statement reading the holders of these keys: several are planned for their values
    each time (see _holding_sql)."""
    return planned_for_its_values(Task) if len(keys) > 1 else contextlib.nullcontext()


@functools.lru_cache(maxsize=64)
def _holding_sql(vendor: str, alias: str, count: int) -> str:
    """`count` keys (0: an array of any number of them, PostgreSQL). One key is looked up in the
    tenant's index of keys by any plan (the index is unique). Several, on PostgreSQL, one by one
    in that index, planned for their values each time (`planned_for_its_values`): asked as
    `key IN (…)`, or by a plan made while the table was small, PostgreSQL without statistics (a
    fresh installation's first minute) read every task of the tenant for the keys, or for each
    key (10 ms for a batch's at 27,000 tasks)."""
    if count == 0:
        return (f"{alias}.id IN (SELECT h.id FROM unnest(%s::varchar[]) AS q(key) CROSS JOIN LATERAL "
                f"(SELECT h.id FROM tasks_task h WHERE h.tenant_id = %s AND h.idempotency_key = q.key LIMIT 1) h)")
    return f"{alias}.tenant_id = %s AND {alias}.idempotency_key IN ({', '.join(['%s'] * count)})"


def _files_of(tenant: Tenant, work: list[_Item], *, try_keys: list[tuple] | None = None
              ) -> tuple[dict[int, FileVersion | None], list[bool] | None]:
    """Each item's file (None: not the tenant's, or deleted), and with `try_keys` (PostgreSQL, in
    the write transaction) those locks tried in the same statement, as locks.try_each answers."""
    wanted = {_uuid_or_none(item.request.file_id) for item in work} - {None}
    # (The locks are tried on the default database's connection, in the files' statement only
    # where the files are read there.)
    together = bool(try_keys) and bool(wanted) and router.db_for_read(FileVersion) == DEFAULT_DB_ALIAS
    tried = locks.try_each_sql(try_keys) if together else None
    found = select(
        FileVersion, f"id IN ({', '.join(['%s'] * len(wanted))}) AND tenant_id = %s AND deleted_at IS NULL",
        [*(("id", pk) for pk in wanted), ("tenant", tenant.pk)],
        extra={"keys_taken": tried[0]} if tried else None) if wanted else []
    by_id = {f.pk: f for f in found}
    if try_keys is None:
        taken = None
    else:
        taken = tried[1](found[0].keys_taken if found else None) if tried else locks.try_each(try_keys)
    return {item.index: by_id.get(_uuid_or_none(item.request.file_id)) for item in work}, taken


def _holders_column(tenant: Tenant, keys: list[str], *, first_lane: str) -> tuple[str, str, list]:
    """The tasks holding these keys of the tenant as one JSON column of the lanes' read (`also`),
    on the first lane's row only: an array of [key, task id, accepted at, fingerprint]."""
    connection = connections[router.db_for_read(Task)]
    holding, params = _holding(connection, "k", tenant, keys)
    return "key_holders", _holders_sql(connection.vendor, holding), [(None, v) for v in (first_lane, *params)]


def _key_fingerprint(task: str) -> str:
    """The fingerprint of the request that made the task aliased `task`, as SQL (a task a process
    of the release before migration 0025 accepted has it in the key's record only)."""
    return (f"COALESCE({task}.idempotency_fingerprint, "
            f"(SELECT r.fingerprint FROM tasks_idempotencyrecord r WHERE r.task_id = {task}.id))")


@functools.lru_cache(maxsize=64)
def _holders_sql(vendor: str, holding: str) -> str:
    rows = json_rows_sql(vendor, f"k.idempotency_key, k.id, k.created_at, {_key_fingerprint('k')}")
    return f"CASE WHEN t.name = %s THEN (SELECT {rows} FROM tasks_task k WHERE {holding}) END"


def _holders(column: Any) -> dict[str, Task]:
    """The key holders as `_tasks_by_key` gives them, from their JSON column."""
    holders = {}
    for key, task_id, accepted_at, fingerprint in json_rows(column):
        task = Task(id=uuid.UUID(str(task_id)), idempotency_key=key, created_at=moment(accepted_at))
        task.key_fingerprint = fingerprint
        holders[key] = task
    return holders


def _lane_for(file: FileVersion, priority: str) -> str:
    """The task's provisional lane: from its size, and from its pre-check where that has run."""
    findings = file.precheck_findings if file.precheck_state == FileVersion.Precheck.PASSED else None
    return ROUTING.lane_for(priority=priority, size=file.size, findings=findings)


def _admit_one(*, tenant: Tenant, item: _Item, file: FileVersion | None, quota: EffectiveQuota, usage: QuotaUsage | None,
               lanes: _Lanes, actor: str, now) -> tuple[Task, TaskEvent]:
    """The rows of one accepted submission (not yet saved), or the error that refuses it."""
    request = item.request
    if file is None:
        raise FileNotFound()
    if file.precheck_state == FileVersion.Precheck.QUARANTINED:
        reason = (file.precheck_findings or {}).get("reason", "pre-check")
        raise FileQuarantined(f"This file is quarantined ({reason}); an operator must release it before it can be processed.")
    sniffed_family = filetypes.FAMILY_BY_MIME.get(file.detected_type)
    if sniffed_family and sniffed_family in (filetypes.AUDIO, filetypes.DOCUMENT, filetypes.TEXT):
        if sniffed_family not in filetypes.INPUT_FAMILIES[request.kind]:
            raise InvalidRequest(
                f"This file is {sniffed_family}; {request.kind} needs "
                f"{' or '.join(sorted(filetypes.INPUT_FAMILIES[request.kind]))}.", field="kind",
            )
    findings = file.precheck_findings if file.precheck_state == FileVersion.Precheck.PASSED else None
    units = _estimated_units(request.kind, findings)
    if usage is not None:
        refused = usage.refusal(quota, size=file.size, units=units, now=now)
        if refused is not None:
            raise refused
    lane = lanes.lanes[_lane_for(file, request.priority)]
    deferred = _admit(lane, priority=request.priority, lanes=lanes)
    task, event = accepted_rows(tenant=tenant, file=file, request=request, lane=lane, units=units, deferred=deferred,
                                key=item.key, fingerprint=item.fingerprint, actor=actor, now=now)
    lanes.accepted(lane, now)
    if usage is not None:
        usage.add(size=file.size, units=units, now=now)
    return task, event


def accepted_rows(*, tenant: Tenant, file: FileVersion, request: SubmitRequest, lane: Lane, units: int | None,
                  deferred: bool, key: str | None, actor: str, now, fingerprint: str | None = None) -> tuple[Task, TaskEvent]:
    """The (unsaved) rows an accepted task starts as: the task in ACCEPTED and its first event."""
    deadline_s = request.deadline_s or DEFAULT_DEADLINE_S
    deadline_at = now + timescale.delta(deadline_s)
    queue_deadline_at = now + timescale.delta(lane.queue_deadline_s)
    task = new_row(
        Task, tenant=tenant, file=file, kind=request.kind, target_format=request.target_format, params=request.params,
        priority=request.priority, lane=lane, callback_url=request.callback_url, idempotency_key=key or None,
        idempotency_fingerprint=fingerprint if key else None,
        deadline_at=deadline_at, queue_deadline_at=queue_deadline_at,
        dispatch_deadline_at=min(deadline_at, queue_deadline_at),
        estimated_units=units, deferred=deferred, due_at=now, enqueued_at=now,
    )
    event = new_row(
        TaskEvent, task=task, from_state="", to_state=State.ACCEPTED, generation=0, actor=actor[:100],
        reason="accepted" + (" (deferred: lane full)" if deferred else ""),
        data={"lane": lane.name, "priority": request.priority},
    )
    return task, event


def _admit(lane: Lane, *, priority: str, lanes: _Lanes) -> bool:
    """Close the door explicitly when the lane cannot keep its promise to new work; True means
    deferred. The gate decides (tasks/scheduling/admission.py); the lane's policy says what a
    closed gate does: reject answers 503 with Retry-After, defer accepts and parks the task, shed
    drops the lane's oldest waiting task to make room."""
    gate = _gate(lane, lanes.load(lane))
    if gate.state == "open":
        return False
    if lanes.tentative:
        raise _GateClosed()
    retry_after = max(timescale.seconds(30), 1)
    if lane.overflow_policy == Lane.Overflow.DEFER:
        return True
    if lane.overflow_policy == Lane.Overflow.SHED_OLDEST:
        shed = (
            Task.objects.filter(lane=lane, state=State.QUEUED, dispatched_at__isnull=True)
            .order_by("queued_at", "created_at").values("pk", "generation").first()
        )
        if shed is not None and task_move(
            shed["pk"], source=State.QUEUED, target=State.EXPIRED, generation=shed["generation"],
            actor="admission", reason=f"shed: lane {lane.name} was closing ({gate.reason}) and dropped its oldest waiting task",
            fields=dict(error_code="shed", error_message="the lane was full; the oldest waiting task was shed"),
            # Admission may have dispatched it since it was read (reserving its slots and sending
            # its start, without moving it): a task on its way to run is not shed.
            expect={"dispatched_at": None},
        ):
            lanes.shed(lane)
            return False
    raise BacklogFull(f"Admission to lane {lane.name} is closed: {gate.reason}; retry later.",
                      retry_after=retry_after, lane=lane.name)


def _gate(lane: Lane, load: LaneLoad):
    return admission_gate(max_queued=lane.max_queued, max_running=lane.max_running, early_close_pct=lane.early_close_pct,
                          oldest_wait_limit_s=lane.oldest_wait_limit_s, busy_close_pct=lane.busy_close_pct, load=load)


def _estimated_units(kind: str, findings: dict[str, Any] | None) -> int | None:
    if not findings:
        return None
    if kind == "transcription" and findings.get("audio_minutes") is not None:
        import math

        return max(1, math.ceil(findings["audio_minutes"]))
    if kind == "conversion" and findings.get("pages"):
        return int(findings["pages"])
    return None


def _uuid_or_none(value: str):
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


# --- after acceptance: pre-check and routing ---------------------------------------------------
@dataclass(frozen=True)
class Routed:
    """A pre-check's outcome; a task admitted as it arrived comes with it, as the move wrote it."""

    outcome: str
    task: Task | None = None


def task_precheck_and_route(task_id: Any, generation: int) -> str:
    """ACCEPTED → QUEUED in its lane (or FAILED, quarantined), its start sent when it is admitted.
    A worker that runs the lane's steps itself uses task_precheck_and_route_here: a task admitted
    there is claimed for it in the same move, and only the worker holding it may carry it on."""
    return task_precheck_and_route_here(task_id, generation).outcome


def task_precheck_and_route_here(task_id: Any, generation: int, *, worker_lane: str | None = None) -> Routed:
    """ACCEPTED → QUEUED in its lane (or FAILED, quarantined). Runs on the provisional lane's
    workers; `worker_lane` is the lane whose cluster runs this worker, which starts the task
    itself if it is admitted into that lane at once ("queued_here": no start message was sent),
    with the task as the move wrote it when it was admitted and claimed for it as it arrived
    (the worker starts it without reading it again)."""
    task, lease = Lease.claim_read(task_id, State.ACCEPTED, generation, related=("file", "lane", "tenant"),
                                   extra={"has_entries": content_has_entries()})
    if task is None:
        return Routed("stale")
    if lease is None:
        return Routed("busy")
    file = task.file
    entries = content_entries(task.tenant_id, file.sha256) if bool(task.has_entries) else []
    # A passing verdict is recorded with the move it decides (in its statement), whatever came of it.
    recorded: tuple[Write, ...] = ()
    if file.precheck_state == FileVersion.Precheck.PENDING:
        file, verdict = file_precheck_with(file=file, entries=entries)
        recorded = (verdict,) if verdict is not None else ()
    findings = file.precheck_findings or {}
    if file.precheck_state == FileVersion.Precheck.QUARANTINED:
        task_move(
            task.pk, source=State.ACCEPTED, target=State.FAILED, generation=generation, actor="precheck",
            reason=f"quarantined: {findings.get('reason')}",
            fields=dict(error_code="quarantined", error_message=f"the file was quarantined ({findings.get('reason')})",
                        lease_owner="", lease_expires_at=None),
        )
        return Routed("quarantined")
    family = findings.get("family")
    if family in (filetypes.AUDIO, filetypes.DOCUMENT, filetypes.TEXT) and family not in filetypes.INPUT_FAMILIES[task.kind]:
        task_move(
            task.pk, source=State.ACCEPTED, target=State.FAILED, generation=generation, actor="precheck",
            reason="input does not fit the kind",
            fields=dict(error_code="input_mismatch",
                        error_message=f"the file is {family}; {task.kind} needs {' or '.join(sorted(filetypes.INPUT_FAMILIES[task.kind]))}",
                        lease_owner="", lease_expires_at=None),
            writes=recorded,
        )
        return Routed("input_mismatch")
    # Content let out of quarantine (by an operator, or lifted after an engine upgrade) runs in
    # the unknown-risk lane, under its strict budget, whichever upload of it this is.
    released = bool(findings.get("released")) or released_from_poison(entries)
    lane_name = ROUTING.lane_for(priority=task.priority, size=file.size, findings=findings, released=released)
    here = lane_name == worker_lane
    arrival = task_queue_on_arrival(
        task, lane_name, estimated_units=_estimated_units(task.kind, findings), actor="precheck", starting_here=here,
        data={"lane": lane_name, "pages": findings.get("pages"), "audio_minutes": findings.get("audio_minutes")},
        writes=recorded)
    if arrival.outcome == "dispatched":
        return Routed("queued_here", task) if here else Routed("queued")
    if arrival.outcome != "queued":
        return Routed(arrival.outcome)
    if not arrival.lane.paused:
        sent = admit_lane(arrival.lane, timezone.now(), starting_here=task.pk if here else None, looked=arrival.standing)
        if here and any(str(task_id) == str(task.pk) for task_id, _, _ in sent):
            return Routed("queued_here")
    return Routed("queued")
