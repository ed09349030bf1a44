"""The task lifecycle: the one table of allowed transitions and the one function that writes state.

Every state change is a compare-and-set UPDATE (`WHERE id AND state AND generation`) that bumps
the generation and appends a TaskEvent in the same transaction. The generation is the fencing
token: whoever read the task at generation N can only write while it is still at N. An update
count of 0 means someone else moved the task first; callers handle that, it is not an error.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections, router, transaction
from django.db.models import F, Model, QuerySet
from django.db.models.sql import UpdateQuery
from django.utils import timezone
from django_q.models import OrmQ

from tasks import rows
from tasks.models import Attempt, BudgetSlot, FileVersion, Task, TaskEvent, VendorCall
from tasks.rows import insert_rows, new_row
from tasks.states import State

S = State

# from-state → the states it may move to. Self-transitions exist only to fence (bump the
# generation of) a step whose lease expired, so a zombie worker can no longer write.
TRANSITIONS: dict[State, frozenset[State]] = {
    S.ACCEPTED: frozenset({S.QUEUED, S.FAILED, S.CANCELLED, S.EXPIRED}),
    # QUEUED → RETRY_WAIT parks work no channel can take (every vendor down): it waits durably
    # for recovery instead of running out its queue deadline.
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED, S.EXPIRED, S.FAILED, S.RETRY_WAIT}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.RETRY_WAIT, S.RECONCILING, S.FAILED, S.CANCEL_REQUESTED}),
    S.RETRY_WAIT: frozenset({S.QUEUED, S.CANCELLED, S.FAILED}),
    S.RECONCILING: frozenset({S.RUNNING, S.RETRY_WAIT, S.FAILED, S.CANCEL_REQUESTED, S.RECONCILING}),
    S.CANCEL_REQUESTED: frozenset({S.CANCELLED, S.CANCEL_REQUESTED}),
    S.SUCCEEDED: frozenset(),
    # Operators replay failed or expired work (dead letters, released quarantine): a new
    # generation of the same task, never a new task.
    S.FAILED: frozenset({S.QUEUED}),
    S.CANCELLED: frozenset(),
    S.EXPIRED: frozenset({S.QUEUED}),
}

# Columns that only this module may write.
_PROTECTED = {"state", "generation", "id", "tenant", "tenant_id", "moves_note"}


class IllegalTransition(Exception):
    """The lifecycle table does not allow this transition."""


def is_allowed(source: State | str, target: State | str) -> bool:
    return State(target) in TRANSITIONS[State(source)]


@dataclass(frozen=True)
class Moved:
    """A transition that happened: the task is now at `generation`. `said`: the values of the
    move's `returning` expressions on the moved row (None: none asked, or the change was one the
    ORM writes, whose statement does not carry them: the caller reads the row instead)."""

    generation: int
    said: tuple | None = None


@dataclass(frozen=True)
class Hop:
    """One more transition in the same move (`transition(..., then=[Hop(...)])`), recorded as its own
    history entry."""

    target: State | str
    actor: str
    reason: str
    data: dict[str, Any] | None = None


def transition(
    task_id: Any,
    *,
    source: State | str,
    target: State | str,
    generation: int,
    actor: str,
    reason: str,
    fields: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    at: datetime | None = None,
    then: list[Hop] | None = None,
    returning: tuple[str, ...] = (),
    writes: tuple[rows.Write, ...] = (),
    expect: dict[str, Any] | None = None,
) -> Moved | None:
    """Move a task from `source` at `generation` to `target`; None if it was not there any more
    (or, with `expect`, if those columns no longer hold what the caller read: None for NULL).
    `at`: the moment the move is stamped with (now), when the caller wrote that moment in `fields` too.
    `then`: transitions on from `target` made in the same compare-and-set, each allowed by the
    table and each with its history entry and its generation (a worker that admits a task and
    claims it at once: QUEUED, then RUNNING); `fields` are what the row holds after the last.
    `returning`: SQL expressions over the moved row, as it is after the move, whose values the
    move's own statement returns (`Moved.said`, in their order), for a caller that would otherwise
    read the row again; the row's columns are written `{row}.<column>` (its alias on PostgreSQL;
    SQLite's RETURNING knows the table by its own name only).
    `writes`: other rows' writes that commit with the move (`rows.Write`: the attempt's end, the
    slots an admission reserves), in the move's own statement on PostgreSQL."""
    hops = [Hop(target, actor, reason, data), *(then or [])]
    states = [State(source), *(State(hop.target) for hop in hops)]
    for before, after in zip(states, states[1:], strict=False):
        if not is_allowed(before, after):
            raise IllegalTransition(f"{before} → {after} is not in the lifecycle table")
    changes = dict(fields or {})
    if _PROTECTED & changes.keys():
        raise IllegalTransition(f"transition fields may not include {_PROTECTED & changes.keys()}")
    now = at or timezone.now()
    changes.update(state=states[-1], generation=F("generation") + len(hops), updated_at=now)
    row = _cas_conditions(task_id, states[0], generation, expect)
    events = [new_row(TaskEvent, task_id=task_id, from_state=before, to_state=hop.target, generation=generation + n,
                      actor=hop.actor[:100], reason=hop.reason[:300], data=hop.data or {}, at=now)
              for n, (before, hop) in enumerate(zip(states, hops, strict=False), start=1)]
    alias = router.db_for_write(Task)
    returning = _over_the_row(returning, alias)
    if connections[alias].vendor == "postgresql":
        moved, said = _update_and_record(row, changes, events, returning=returning, writes=writes)
    else:
        moved, said = _update_noted(row, changes, events, returning=returning, writes=writes, alias=alias)
    return Moved(generation=generation + len(hops), said=said) if moved else None


def _update_noted(row: dict[str, Any], changes: dict[str, Any], events: list[TaskEvent], *,
                  returning: tuple[str, ...], writes: tuple[rows.Write, ...], alias: str) -> tuple[bool, tuple | None]:
    """The compare-and-set, its history entries and the writes that go with it in one statement
    (SQLite, which has no writable WITH): the UPDATE writes them into the row's `moves_note` and
    the trigger `task_moves_recorded` writes them as the row is written, so they exist exactly
    when the row moved. A write the trigger cannot make (`_carried`) runs after the move, a
    statement of its own in one transaction with it (inside a caller's transaction no savepoint
    of its own: a failure fails the caller's); a write to be made whatever came of the move is
    made by a statement of its own when the row did not move."""
    connection = connections[alias]
    carried, noted, rest = _carried(writes, alias)
    changes["moves_note"] = _note(events, connection, at=changes["updated_at"], carried=noted)

    def moved_and_written() -> tuple[bool, tuple | None]:
        moved, said = _update_returning(row, changes, returning) if returning else (bool(_update(row, changes)), None)
        _run_writes(rest, moved=moved)
        if not moved:
            _run_writes(carried, moved=False)
        return moved, said

    if not rest:
        return moved_and_written()
    with transaction.atomic(using=alias, savepoint=False):
        return moved_and_written()


# A note is never the one the row holds already (the trigger copies only a changed note), even for
# two equal findings in the same microsecond.
_NOTES = itertools.count()


def _note(events: list[TaskEvent], connection: Any, *, at: datetime | None, carried: dict[str, Any]) -> str:
    """`moves_note`: the entries as the history's columns hold them, the writes the trigger makes
    (`_carried`), and the moment they are stamped with, which is the row's `updated_at` in the
    same write (the trigger's check: a row written back whole from an older read carries an older
    note and a newer `updated_at`)."""
    fields = [TaskEvent._meta.get_field(name) for name in _EVENT_COLUMNS[1:]]
    entries = [[field.get_db_prep_save(getattr(event, field.attname), connection) for field in fields]
               for event in events]
    stamp = None if at is None else Task._meta.get_field("updated_at").get_db_prep_save(at, connection)
    return json.dumps({"n": next(_NOTES), "at": stamp, "e": entries, **carried}, separators=(",", ":"))


# What a move's note carries to SQLite's trigger besides its history entries: rows of these models
# inserted, and changes to rows of these found by an equality on the first field named (the first
# column of an index) and then by any of the others (a value, NULL, or one of a list).
NOTED_INSERTS: tuple[type[Model], ...] = (Attempt, BudgetSlot, VendorCall)
NOTED_CHANGES: dict[type[Model], tuple[str, ...]] = {
    Attempt: ("task", "generation", "ended_at"),
    BudgetSlot: ("task", "kind", "released_at"),
    FileVersion: ("id", "precheck_state"),  # a pre-check's verdict, with the move it decides
}


def _carried(writes: tuple[rows.Write, ...], alias: str) -> tuple[tuple[rows.Write, ...], dict[str, Any], tuple[rows.Write, ...]]:
    """`writes` split into those the note carries (and the note's part for them: {"i": {table:
    rows}, "u": {table: changes}}) and the rest."""
    carried, rest = [], []
    noted: dict[str, dict[str, list]] = {}
    if not _triggers_ready(alias):
        return (), noted, writes
    inserts = _noted_inserts()
    for write in writes:
        found = None
        if router.db_for_write(write.model) != alias:
            pass
        elif write.rows and write.model in inserts:
            found = write.noted(alias)
        elif not write.rows and write.model in NOTED_CHANGES:
            names = NOTED_CHANGES[write.model]
            match = dict(write.match)
            key = match.get(names[0])
            if set(match) <= set(names) and key is not None and not isinstance(key, (list, tuple)):
                found = write.noted(alias)
        if found is None:
            rest.append(write)
            continue
        kind, what = found
        part = noted.setdefault(kind, {}).setdefault(write.model._meta.db_table, [])
        part.extend(what) if kind == "i" else part.append(what)
        carried.append(write)
    return tuple(carried), noted, tuple(rest)


HISTORY_TRIGGER = "task_moves_recorded"
INSERT_TRIGGER = "task_inserted_recorded"


def note_triggers_sql(alias: str = "default") -> dict[str, str]:
    """SQLite's triggers that write what a task's `moves_note` carries (its history entries and
    the writes that go with them) as the row is written: `HISTORY_TRIGGER` for a move or an update
    (see `_update_noted`): only when the write names the note, changes it, and stamps the row with
    the note's moment; `INSERT_TRIGGER` for a new task (`inserted_with`): only when the note names
    the row's own id (a row copied with another's note writes nothing). The changes first, then
    the rows inserted: as in PostgreSQL's WITH, a change does not reach a row written with it."""
    task, event = Task._meta, TaskEvent._meta
    quote = connections[alias].ops.quote_name
    columns = ", ".join(event.get_field(name).column for name in _EVENT_COLUMNS)
    values = ", ".join(f"json_extract(value, '$[{n}]')" for n in range(len(_EVENT_COLUMNS) - 1))
    note, stamped, pk = task.get_field("moves_note").column, task.get_field("updated_at").column, task.pk.column
    statements = [f"INSERT INTO {event.db_table} ({columns}) SELECT NEW.{pk}, {values} "
                  f"FROM json_each(NEW.{note}, '$.e') ORDER BY key"]

    def named(table: str) -> str:
        # The note, only when it names the table: a write of a table it does not name costs a
        # string search, not a parse of the note (SQLite parses the JSON again for each statement).
        return f"(SELECT NEW.{note} AS n WHERE instr(NEW.{note}, '\"{table}\"') > 0) g"

    for model, names in NOTED_CHANGES.items():
        table = model._meta.db_table
        sets = ", ".join(f"{quote(f.column)} = CASE WHEN json_type(u.value, '$.s.{f.column}') IS NULL "
                         f"THEN {table}.{quote(f.column)} ELSE json_extract(u.value, '$.s.{f.column}') END"
                         for f in model._meta.concrete_fields if not f.primary_key)
        key = model._meta.get_field(names[0]).column
        conditions = [f"{table}.{quote(key)} = json_extract(u.value, '$.m.{key}')"]
        for name in names[1:]:
            column = model._meta.get_field(name).column
            read, here = f"'$.m.{column}'", f"{table}.{quote(column)}"
            conditions.append(
                f"CASE COALESCE(json_type(u.value, {read}), 'absent') WHEN 'absent' THEN 1 WHEN 'null' THEN {here} IS NULL "
                f"WHEN 'array' THEN {here} IN (SELECT value FROM json_each(u.value, {read})) "
                f"ELSE {here} = json_extract(u.value, {read}) END")
        statements.append(f"UPDATE {table} SET {sets} FROM (SELECT j.value FROM {named(table)}, "
                          f"json_each(g.n, '$.u.{table}') j) AS u WHERE {' AND '.join(conditions)}")
    for model in _noted_inserts():
        table, fields = model._meta.db_table, rows.insert_fields(model, alias)
        statements.append(f"INSERT INTO {table} ({', '.join(quote(f.column) for f in fields)}) "
                          f"SELECT {', '.join(f'json_extract(j.value, {chr(39)}$.{f.column}{chr(39)})' for f in fields)} "
                          f"FROM {named(table)}, json_each(g.n, '$.i.{table}') j ORDER BY j.key")
    body = f"BEGIN {'; '.join(statements)}; END"
    return {
        HISTORY_TRIGGER: (f"CREATE TRIGGER {HISTORY_TRIGGER} AFTER UPDATE OF {note} ON {task.db_table} FOR EACH ROW "
                          f"WHEN NEW.{note} IS NOT NULL AND NEW.{note} IS NOT OLD.{note} "
                          f"AND json_extract(NEW.{note}, '$.at') = NEW.{stamped} {body}"),
        INSERT_TRIGGER: (f"CREATE TRIGGER {INSERT_TRIGGER} AFTER INSERT ON {task.db_table} FOR EACH ROW "
                         f"WHEN NEW.{note} IS NOT NULL AND json_extract(NEW.{note}, '$.id') = NEW.{pk} {body}"),
    }


def _noted_inserts() -> tuple[type[Model], ...]:
    return (*NOTED_INSERTS, OrmQ)  # (the embedded broker's messages, where they share the tasks' database)


def history_trigger_install(apps: Any, schema_editor: Any) -> None:
    """Migrations 0029 and 0030: the triggers on SQLite (as this code writes them); PostgreSQL
    writes the entries in the move's WITH."""
    connection = schema_editor.connection
    if connection.vendor == "sqlite":
        for name, sql in note_triggers_sql(connection.alias).items():
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {name}", params=None)
            schema_editor.execute(sql, params=None)


def history_trigger_remove(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "sqlite":
        for name in (HISTORY_TRIGGER, INSERT_TRIGGER):
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {name}", params=None)


def note_triggers_current(using: str = "default") -> bool:
    """Whether the database's triggers are the ones this code writes (a model whose columns
    changed without its triggers written again would have its rows written without them)."""
    connection = connections[using]
    if connection.vendor != "sqlite":
        return True
    wanted = note_triggers_sql(using)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND name IN ({', '.join(['%s'] * len(wanted))})",
                       list(wanted))
        return dict(cursor.fetchall()) == wanted


_READY: dict[str, bool] = {}


def _triggers_ready(alias: str) -> bool:
    """Whether the database's triggers write what this code's notes carry, asked once a process
    (code deployed before its migration ran: the writes are made by statements of their own)."""
    return note_triggers_read(alias, unless_known=True)


def note_triggers_read(alias: str, *, unless_known: bool = False) -> bool:
    """Ask the database whether its triggers are this code's (again, unless `unless_known`), and
    keep the answer for this process (asked as a connection opens and after `migrate`)."""
    if not unless_known or alias not in _READY:
        _READY[alias] = note_triggers_current(alias)
    return _READY[alias]


def inserted_with(task: Task, events: list[TaskEvent], writes: tuple[rows.Write, ...] = ()) -> tuple[rows.Write, ...]:
    """SQLite: the new `task`'s INSERT carries its first history entries and `writes` in its note
    (`INSERT_TRIGGER` writes them as the row is written); the writes it cannot carry are returned,
    for the caller to write in its transaction after the task. Elsewhere, or where the database's
    triggers are not this code's, nothing is carried (the entries are returned as a write too)."""
    alias = router.db_for_write(Task)
    connection = connections[alias]
    if connection.vendor != "sqlite" or not _triggers_ready(alias):
        return (rows.Write.insert(events), *writes) if events else writes
    _, noted, rest = _carried(writes, alias)
    pk = Task._meta.pk.get_db_prep_value(task.pk, connection)
    task.moves_note = _note(events, connection, at=None, carried={"id": pk, **noted})
    return rest


def _run_writes(writes: tuple[rows.Write, ...], *, moved: bool) -> None:
    """The writes that go with a move, each as a statement of its own (SQLite), after it."""
    for write in writes:
        if moved or not write.if_moved:
            write.run()


def _over_the_row(returning: tuple[str, ...], alias: str) -> tuple[str, ...]:
    """`returning`'s expressions with the moved row named as the database's UPDATE knows it."""
    if not returning:
        return ()
    connection = connections[alias]
    table = "t" if connection.vendor == "postgresql" else connection.ops.quote_name(Task._meta.db_table)
    return tuple(expression.replace("{row}", table) for expression in returning)


def _update(conditions: dict[str, Any], changes: dict[str, Any]) -> int:
    """The compare-and-set's UPDATE of the task at `conditions` (its id, state and generation, and
    what the caller expects of it): a statement built once per shape (tasks/rows.py) when the
    conditions are plain fields and the changes values or `F(field) ± n`, else the ORM's (the
    same SQL, compiled for each call)."""
    built = _built(conditions, changes)
    if built is None:
        return _matching(conditions).update(**changes)
    alias = router.db_for_write(Task)
    with transaction.mark_for_rollback_on_error(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(*built)
        return cursor.rowcount


def _update_returning(conditions: dict[str, Any], changes: dict[str, Any],
                      returning: tuple[str, ...]) -> tuple[bool, tuple | None]:
    """`_update` whose statement also returns `returning` of the row it changed: (moved, their
    values), or (moved, None) when the change is one the ORM writes (its statement has no alias)."""
    built = _built(conditions, changes, returning=", ".join(returning))
    if built is None:
        return bool(_matching(conditions).update(**changes)), None
    alias = router.db_for_write(Task)
    with transaction.mark_for_rollback_on_error(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(*built)
        found = cursor.fetchall()
    return bool(found), (tuple(found[0]) if found else None)


def _built(conditions: dict[str, Any], changes: dict[str, Any], returning: str = "") -> tuple[str, list[Any]] | None:
    matched = rows.matching(Task, conditions)
    return None if matched is None else rows.update_sql(Task, changes, *matched, returning=returning)


def _matching(conditions: dict[str, Any]) -> QuerySet:
    others = dict(conditions)
    return Task.objects.filter(pk=others.pop("id"), **others)


_EVENT_COLUMNS = ("task_id", "from_state", "to_state", "generation", "actor", "reason", "data", "at")


def _update_and_record(row: dict[str, Any], changes: dict[str, Any], events: list[TaskEvent], *,
                       returning: tuple[str, ...] = (), writes: tuple[rows.Write, ...] = ()) -> tuple[bool, tuple | None]:
    """The compare-and-set and its history entries in one statement (PostgreSQL): the UPDATE's
    RETURNING feeds the INSERT, so the entries exist exactly when the row moved, without a
    transaction of their own or a second round trip. With `returning`, the statement also
    returns their values on the moved row: (moved, those values; None when the ORM built the UPDATE).
    `writes` are statements of the same WITH (`rows.Write.over_moved`)."""
    alias = router.db_for_write(Task)
    connection = connections[alias]
    pk = connection.ops.quote_name(Task._meta.pk.column)
    said = [f"said{n}" for n in range(len(returning))]
    read = [f"({expression}) AS {name}" for expression, name in zip(returning, said, strict=True)]
    built = _built(row, changes, returning=", ".join([f"t.{pk}", *read]))
    if built is not None:
        update_sql, update_params = built
    else:
        returning = ()  # the ORM's UPDATE has no alias for the expressions' `t`: the caller reads
        query = _matching(row).query.chain(UpdateQuery)
        query.add_update_values(changes)
        compiler = query.get_compiler(alias)
        compiler.pre_sql_setup()
        update_sql, update_params = compiler.as_sql()
        update_sql += f" RETURNING {pk}"
    fields = [TaskEvent._meta.get_field(name) for name in _EVENT_COLUMNS]
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    casts = ", ".join(f"%s::{field.db_type(connection)}" for field in fields[1:])
    names = ", ".join(f"c{n}" for n in range(1, len(fields)))
    values = [field.get_db_prep_save(getattr(event, field.attname), connection) for event in events for field in fields[1:]]
    entries = ", ".join([f"({casts})"] * len(events))
    record = (f"INSERT INTO {connection.ops.quote_name(TaskEvent._meta.db_table)} ({columns}) "
              f"SELECT moved.{pk}, {names} FROM moved CROSS JOIN (VALUES {entries}) AS entries ({names}) "
              f"ORDER BY c{_EVENT_COLUMNS.index('generation')}")  # ids in the order of the moves
    with_moved, with_params = _with_moved(update_sql, update_params, writes)
    with connection.cursor() as cursor:
        if not returning:
            cursor.execute(f"{with_moved} {record}", (*with_params, *values))
            return cursor.rowcount == len(events), None
        # A data-modifying WITH runs whether or not the statement reads it: the entries are
        # written exactly when the row moved, as above (and so are the writes).
        cursor.execute(f"{with_moved}, recorded AS ({record}) "
                       f"SELECT {', '.join(f'moved.{name}' for name in said)} FROM moved",
                       (*with_params, *values))
        found = cursor.fetchall()
        return bool(found), (tuple(found[0]) if found else None)


def _with_moved(update_sql: str, update_params: list[Any], writes: tuple[rows.Write, ...]) -> tuple[str, list[Any]]:
    """`WITH moved AS (<the move's UPDATE … RETURNING>), w0 AS (<a write>), …` and its parameters
    (PostgreSQL): the writes see the moved row as `moved` (rows.Write.over_moved)."""
    parts, params = [f"WITH moved AS ({update_sql})"], list(update_params)
    for n, write in enumerate(writes):
        sql, values = write.over_moved()
        parts.append(f"w{n} AS ({sql})")
        params += values
    return ", ".join(parts), params


def task_update(task_id: Any, *, state: State | str, generation: int, expect: dict[str, Any] | None = None,
                writes: tuple[rows.Write, ...] = (), **fields: Any) -> bool:
    """Write non-state columns only if the task is still at (state, generation) and, with
    `expect`, those columns still hold what the caller read. `writes` (`rows.Write`) go with the
    update: in its statement (PostgreSQL's WITH, SQLite's note), or as `transition`'s."""
    if _PROTECTED & fields.keys():
        raise IllegalTransition("use transition() to change state or generation")
    fields["updated_at"] = timezone.now()
    conditions = _cas_conditions(task_id, state, generation, expect)
    alias = router.db_for_write(Task)
    if writes and connections[alias].vendor == "sqlite":  # the writes in the update's note
        return _update_noted(conditions, fields, [], returning=(), writes=writes, alias=alias)[0]
    if writes and connections[alias].vendor == "postgresql":
        built = _built(conditions, fields, returning=f"t.{connections[alias].ops.quote_name(Task._meta.pk.column)}")
        if built is not None:
            with_moved, params = _with_moved(*built, writes)
            with transaction.mark_for_rollback_on_error(using=alias), connections[alias].cursor() as cursor:
                cursor.execute(f"{with_moved} SELECT COUNT(*) FROM moved", params)
                return bool(cursor.fetchone()[0])
        with transaction.atomic(using=alias, savepoint=False):  # the ORM's UPDATE: the writes after it
            updated = bool(_update(conditions, fields))
            _run_writes(writes, moved=updated)
            return updated
    updated = bool(_update(conditions, fields))
    _run_writes(writes, moved=updated)
    return updated


_CAS_KEYS = {"id", "pk", "state", "generation"}


def _cas_conditions(task_id: Any, state: State | str, generation: int, expect: dict[str, Any] | None) -> dict[str, Any]:
    """What a compare-and-set compares: the task's id, state and generation, and the columns the
    caller `expect`s to hold what it read (None for NULL)."""
    if _CAS_KEYS & (expect or {}).keys():
        raise TypeError(f"expect may not name {sorted(_CAS_KEYS & expect.keys())}: the compare-and-set's own")
    return {"id": task_id, "state": state, "generation": generation, **(expect or {})}


def task_update_recorded(task_id: Any, *, state: State | str, generation: int, actor: str, reason: str,
                         data: dict | None = None, returning: tuple[str, ...] = (),
                         writes: tuple[rows.Write, ...] = (), **fields: Any) -> Moved | None:
    """`task_update` and a history entry of it (a finding, not a state change), the entry written
    when the row was: one statement on both databases (as a transition's). None if the
    task was not there any more; else the task at the same generation, with what `returning`
    said (as `transition`'s). `writes`: as `transition`'s."""
    if _PROTECTED & fields.keys():
        raise IllegalTransition("use transition() to change state or generation")
    now = timezone.now()
    fields["updated_at"] = now
    row = {"id": task_id, "state": state, "generation": generation}
    event = new_row(TaskEvent, task_id=task_id, generation=generation, actor=actor[:100], reason=reason[:300],
                    data=data or {}, at=now)
    alias = router.db_for_write(Task)
    returning = _over_the_row(returning, alias)
    if connections[alias].vendor == "postgresql":
        updated, said = _update_and_record(row, fields, [event], returning=returning, writes=writes)
    else:
        updated, said = _update_noted(row, fields, [event], returning=returning, writes=writes, alias=alias)
    return Moved(generation=generation, said=said) if updated else None


def record_event(task_id: Any, *, generation: int, actor: str, reason: str, data: dict | None = None) -> None:
    """Append a history entry that is not a state change (a decision, a finding)."""
    insert_rows([new_row(TaskEvent, task_id=task_id, generation=generation, actor=actor[:100], reason=reason[:300],
                         data=data or {})])
