"""Live counts of the task table kept in single rows (LaneTenantLoad), by database triggers.

Admission control counts a lane's waiting and running tasks on every submission, and every
admission pass counts them per tenant. Counting rows costs as much as the backlog is long (a
flood of 20,000 batch tasks made every submission count 20,000 rows); these counters cost a few
rows whatever the backlog.

Triggers, not application code, keep them: every write to the task table moves them, whichever
code path (a transition, a bulk update, a delete by retention) made it. A task counts in at most
one stage of one (lane, tenant) row:

    accepted    ACCEPTED
    queued      QUEUED, not yet dispatched
    dispatched  QUEUED and dispatched
    in_flight   RUNNING, RECONCILING, CANCEL_REQUESTED
    retry_wait  RETRY_WAIT

SQLite: a trigger per kind of write, run as the row is written (the writer holds the database's
one write lock anyway). PostgreSQL: a deferred constraint trigger, run when the writing transaction
commits: the counter row is locked only for the commit, never while the transaction goes on to
lock task rows (a counter row locked early would let an admission pass and a cancel deadlock).
So on PostgreSQL a transaction does not see its own writes in the counters; the callers read
them before they write (intake under its lane's gate lock, admission under its lock) and add
what they accept themselves.

`counts_check` compares the rows with a live count and repairs them (housekeeping runs it).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from django.db import connection, connections
from django.db.models import DateTimeField, Sum

from tasks.models import Lane, LaneTenantLoad
from tasks.observability import log_event
from tasks.rows import json_rows, json_rows_sql, moment, select
from tasks.states import IN_FLIGHT_STATES, State

STAGES = ("accepted", "queued", "dispatched", "in_flight", "retry_wait")
TABLE = LaneTenantLoad._meta.db_table
TASKS = "tasks_task"


# The states a task counts in, as SQL: a full count reads these by the state index, not the
# finished tasks that are most of the table.
COUNTED = ", ".join(f"'{s}'" for s in (State.ACCEPTED, State.QUEUED, *sorted(IN_FLIGHT_STATES), State.RETRY_WAIT))


def _stage_sql(row: str) -> str:
    """The stage a task row counts in, as SQL (NULL: none)."""
    in_flight = ", ".join(f"'{s}'" for s in sorted(IN_FLIGHT_STATES))
    return (f"CASE WHEN {row}.state = '{State.ACCEPTED}' THEN 'accepted' "
            f"WHEN {row}.state = '{State.QUEUED}' AND {row}.dispatched_at IS NULL THEN 'queued' "
            f"WHEN {row}.state = '{State.QUEUED}' THEN 'dispatched' "
            f"WHEN {row}.state IN ({in_flight}) THEN 'in_flight' "
            f"WHEN {row}.state = '{State.RETRY_WAIT}' THEN 'retry_wait' END")


def _move_sql(row: str, stage: str, sign: int) -> str:
    """Add `sign` to the stage of `row`'s (lane, tenant), when it counts in one: an increment
    creates the row if needed (SELECT ... WHERE, not VALUES: SQLite's parser needs the WHERE before
    ON CONFLICT); a decrement never does (a row wiped with its table, as a flush does, stays gone)."""
    if sign < 0:
        updates = ", ".join(f"{name} = {name} - CASE WHEN {stage} = '{name}' THEN 1 ELSE 0 END" for name in STAGES)
        return (f"UPDATE {TABLE} SET {updates} WHERE lane = COALESCE({row}.lane_id, '') AND tenant = {row}.tenant_id "
                f"AND ({stage}) IS NOT NULL")
    values = ", ".join(f"CASE WHEN {stage} = '{name}' THEN {sign} ELSE 0 END" for name in STAGES)
    updates = ", ".join(f"{name} = {TABLE}.{name} + excluded.{name}" for name in STAGES)
    return (f"INSERT INTO {TABLE} (lane, tenant, {', '.join(STAGES)}) "
            f"SELECT COALESCE({row}.lane_id, ''), {row}.tenant_id, {values} WHERE ({stage}) IS NOT NULL "
            f"ON CONFLICT (lane, tenant) DO UPDATE SET {updates}")


def _sqlite_triggers() -> list[str]:
    old, new = _stage_sql("OLD"), _stage_sql("NEW")
    moved = (f"(({old}) IS NOT ({new}) OR OLD.lane_id IS NOT NEW.lane_id OR OLD.tenant_id IS NOT NEW.tenant_id) "
             f"AND (({old}) IS NOT NULL OR ({new}) IS NOT NULL)")
    return [
        f"CREATE TRIGGER task_counts_insert AFTER INSERT ON {TASKS} FOR EACH ROW WHEN ({new}) IS NOT NULL "
        f"BEGIN {_move_sql('NEW', new, 1)}; END",
        f"CREATE TRIGGER task_counts_update AFTER UPDATE OF state, dispatched_at, lane_id, tenant_id ON {TASKS} "
        f"FOR EACH ROW WHEN {moved} "
        f"BEGIN {_move_sql('OLD', old, -1)}; {_move_sql('NEW', new, 1)}; END",
        f"CREATE TRIGGER task_counts_delete AFTER DELETE ON {TASKS} FOR EACH ROW WHEN ({old}) IS NOT NULL "
        f"BEGIN {_move_sql('OLD', old, -1)}; END",
    ]


def _postgres_triggers() -> list[str]:
    def upsert(row: str, sign: int) -> str:
        return f"{_move_sql(row, f'{row.lower()}_stage', sign)};"

    body = f"""
    DECLARE
        old_stage text;
        new_stage text;
    BEGIN
        IF TG_OP <> 'INSERT' THEN old_stage := {_stage_sql('OLD')}; END IF;
        IF TG_OP <> 'DELETE' THEN new_stage := {_stage_sql('NEW')}; END IF;
        IF TG_OP = 'UPDATE' AND old_stage IS NOT DISTINCT FROM new_stage AND OLD.lane_id IS NOT DISTINCT FROM NEW.lane_id
           AND OLD.tenant_id = NEW.tenant_id THEN
            RETURN NULL;
        END IF;
        -- Two rows are moved in one order everywhere (lane, then tenant), so two committing
        -- transactions that both move a task between the same two rows do not wait for each other.
        IF TG_OP = 'UPDATE' AND (COALESCE(NEW.lane_id, ''), NEW.tenant_id::text) < (COALESCE(OLD.lane_id, ''), OLD.tenant_id::text) THEN
            {upsert('NEW', 1)}
            {upsert('OLD', -1)}
        ELSE
            IF TG_OP <> 'INSERT' THEN {upsert('OLD', -1)} END IF;
            IF TG_OP <> 'DELETE' THEN {upsert('NEW', 1)} END IF;
        END IF;
        RETURN NULL;
    END;"""
    return [
        f"CREATE OR REPLACE FUNCTION task_counts_move() RETURNS trigger LANGUAGE plpgsql AS $$ {body} $$",
        f"CREATE CONSTRAINT TRIGGER task_counts AFTER INSERT OR UPDATE OR DELETE ON {TASKS} "
        f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION task_counts_move()",
    ]


def triggers_install(apps: Any = None, schema_editor: Any = None) -> None:
    """Create the triggers and count what the task table holds (the migration that creates the
    counter table runs this, in its transaction)."""
    statements = _postgres_triggers() if connection.vendor == "postgresql" else _sqlite_triggers()
    stage = _stage_sql(TASKS)
    sums = ", ".join(f"SUM(CASE WHEN stage = '{name}' THEN 1 ELSE 0 END)" for name in STAGES)
    statements += [
        f"DELETE FROM {TABLE}",
        f"INSERT INTO {TABLE} (lane, tenant, {', '.join(STAGES)}) SELECT lane, tenant, {sums} FROM "
        f"(SELECT COALESCE(lane_id, '') AS lane, tenant_id AS tenant, {stage} AS stage FROM {TASKS}) AS staged "
        f"WHERE stage IS NOT NULL GROUP BY lane, tenant",
    ]
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)


def triggers_remove(apps: Any = None, schema_editor: Any = None) -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"DROP TRIGGER IF EXISTS task_counts ON {TASKS}")
            cursor.execute("DROP FUNCTION IF EXISTS task_counts_move()")
        else:
            for name in ("insert", "update", "delete"):
                cursor.execute(f"DROP TRIGGER IF EXISTS task_counts_{name}")


def _live_counts() -> dict[tuple[str, str], dict[str, int]]:
    """The counts as the task table has them now (a full count: for tests and checks)."""
    stage = _stage_sql(TASKS)
    sums = ", ".join(f"SUM(CASE WHEN stage = '{name}' THEN 1 ELSE 0 END)" for name in STAGES)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT lane, tenant, {sums} FROM (SELECT COALESCE(lane_id, '') AS lane, tenant_id AS tenant, "
                       f"{stage} AS stage FROM {TASKS} WHERE state IN ({COUNTED})) AS staged WHERE stage IS NOT NULL "
                       f"GROUP BY lane, tenant")
        rows = cursor.fetchall()
    return {(lane, str(tenant).replace("-", "")): dict(zip(STAGES, values, strict=True)) for lane, tenant, *values in rows}


def counts_check(*, repair: bool = True, quiet: bool = False) -> int:
    """Compare the counter rows with a count of the task table, in one statement (one snapshot:
    a transaction committing meanwhile moves both or neither); with `repair`, add what is missing
    to each wrong row (a difference, not a total, so writes committed since stay counted).
    Returns how many rows were wrong, each logged: a wrong row means a write the triggers missed."""
    stage = _stage_sql(TASKS)
    live = ", ".join(f"CASE WHEN stage = '{name}' THEN 1 ELSE 0 END AS {name}" for name in STAGES)
    stored = ", ".join(f"-{name} AS {name}" for name in STAGES)
    differences = ", ".join(f"SUM({name})" for name in STAGES)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT lane, tenant, {differences} FROM ("
            f"SELECT lane, tenant, {live} FROM (SELECT COALESCE(lane_id, '') AS lane, tenant_id AS tenant, {stage} AS stage "
            f"FROM {TASKS} WHERE state IN ({COUNTED})) AS staged WHERE stage IS NOT NULL "
            f"UNION ALL SELECT lane, tenant, {stored} FROM {TABLE}) AS both_sides "
            f"GROUP BY lane, tenant HAVING " + " OR ".join(f"SUM({name}) <> 0" for name in STAGES))
        wrong = cursor.fetchall()
        for lane, tenant, *missing in wrong:
            if not quiet:
                log_event("task_counts_drift", logging.WARNING, lane=lane, tenant_id=str(tenant),
                          reason=f"missing {dict(zip(STAGES, missing, strict=True))}")
            if repair:
                cursor.execute(
                    f"INSERT INTO {TABLE} (lane, tenant, {', '.join(STAGES)}) VALUES (%s, %s, {', '.join(['%s'] * len(STAGES))}) "
                    f"ON CONFLICT (lane, tenant) DO UPDATE SET "
                    + ", ".join(f"{name} = {TABLE}.{name} + excluded.{name}" for name in STAGES),
                    [lane, tenant, *missing])
    return len(wrong)


# --- reading them ----------------------------------------------------------------------------------
def lane_counts(lane_name: str) -> dict[str, int]:
    """A lane's tasks in each stage, all tenants together."""
    sums = LaneTenantLoad.objects.filter(lane=lane_name).aggregate(**{name: Sum(name) for name in STAGES})
    return {name: sums[name] or 0 for name in STAGES}


def lane_counts_by_tenant(lane_name: str) -> dict[Any, dict[str, int]]:
    """A lane's tasks in each stage, per tenant (tenants with none left out): read on every
    pre-check and admission pass, by a statement built once (`tasks.rows.select`)."""
    rows = select(LaneTenantLoad, "t.lane = %s", [("lane", lane_name)])
    return {row.tenant: {name: getattr(row, name) for name in STAGES} for row in rows
            if any(getattr(row, name) for name in STAGES)}


def lane_with_counts_by_tenant(lane_name: str) -> tuple[Lane | None, dict[Any, dict[str, int]]]:
    """The lane's row and `lane_counts_by_tenant` in one statement (admission reads both under
    its lock on every pass); None for a lane that does not exist."""
    extra = {"load_tenant": "c.tenant", **{f"load_{name}": f"c.{name}" for name in STAGES}}
    lane, counts = None, {}
    for row in select(Lane, "t.name = %s", [("name", lane_name)], extra=extra,
                      join=f"LEFT JOIN {TABLE} c ON c.lane = t.name"):
        lane = lane or row
        stages = {name: int(getattr(row, f"load_{name}") or 0) for name in STAGES}
        if row.load_tenant is not None and any(stages.values()):
            counts[_uuid(row.load_tenant)] = stages
    return lane, counts


def lane_json_sql(alias: str) -> tuple[str, str]:
    """A lane's row (a JSON array of its fields, in the model's order) and its counter rows (as
    `json_rows_sql` aggregates them), as two columns a statement about something else can carry
    (the dispatcher's read of its channels: `channels.rooms_with_lane`); each one placeholder,
    the lane's name. Read back by `lane_from_json`."""
    connection_ = connections[alias]
    quote = connection_.ops.quote_name
    array = "json_build_array" if connection_.vendor == "postgresql" else "json_array"
    columns = ", ".join(f"l.{quote(f.column)}" for f in Lane._meta.concrete_fields)
    row = (f"SELECT {array}({columns}) FROM {quote(Lane._meta.db_table)} l "
           f"WHERE l.{quote(Lane._meta.pk.column)} = %s")
    loads = (f"SELECT {json_rows_sql(connection_.vendor, ', '.join(['c.tenant', *(f'c.{n}' for n in STAGES)]))} "
             f"FROM {TABLE} c WHERE c.lane = %s")
    return row, loads


def lane_from_json(alias: str, row: Any, loads: Any) -> tuple[Lane | None, dict[Any, dict[str, int]]]:
    """The lane and its counts by tenant (as `lane_with_counts_by_tenant` gives them) from the two
    columns of `lane_json_sql` as read; (None, {}) for a lane that does not exist."""
    values = json.loads(row) if isinstance(row, str) else row
    if values is None:
        return None, {}
    fields = Lane._meta.concrete_fields
    lane = Lane.from_db(alias, [f.attname for f in fields], [_from_json(f, v) for f, v in zip(fields, values, strict=True)])
    counts = {}
    for tenant, *stages in json_rows(loads):
        found = {name: int(n or 0) for name, n in zip(STAGES, stages, strict=True)}
        if any(found.values()):
            counts[_uuid(tenant)] = found
    return lane, counts


def _from_json(field: Any, value: Any) -> Any:
    """A field's value as a JSON array carries it (SQLite: timestamps as text, booleans 0 or 1)."""
    if value is None:
        return None
    if isinstance(field, DateTimeField):
        return moment(value)
    return field.to_python(value)


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


# The names of the lanes with tasks waiting for admission (QUEUED, not yet dispatched), as a
# subquery (SQL, for tasks/rows.py's statements): the few counter rows instead of the task table.
LANES_WITH_QUEUED = f"SELECT q.lane FROM {TABLE} q WHERE q.queued > 0"


def tenant_counts(tenant_id: Any) -> dict[str, int]:
    """A tenant's tasks in each stage, all lanes together."""
    sums = LaneTenantLoad.objects.filter(tenant=tenant_id).aggregate(**{name: Sum(name) for name in STAGES})
    return {name: sums[name] or 0 for name in STAGES}



def lanes_with_load(names: list[str], *, also: tuple[str, str, list] | None = None) -> dict[str, Lane]:
    """The lanes, each with what its admission gate weighs, in one statement: `waiting_now`
    (ACCEPTED or queued, not dispatched), `running_now` (holding a slot) and `oldest_waiting_at`
    (found at the start of its index range, whatever the backlog). `also`: one more column the
    caller reads in the same statement (its name, its SQL over the lane `t`, its parameters as
    `tasks.rows.select` takes them).

    Written as SQL: intake runs it on every submission, and compiling the same query through the
    ORM's subqueries cost 1.6 ms a request, ten times what the database spends on it (and read
    through `tasks.rows.select`, not a raw queryset, which costs a few times the statement too)."""

    def oldest(state: str) -> str:
        return (f"SELECT o.created_at FROM {TASKS} o WHERE o.lane_id = t.name AND o.state = '{state}' "
                f"AND o.dispatched_at IS NULL ORDER BY o.created_at LIMIT 1")

    extra = {
        "waiting_now": f"COALESCE((SELECT SUM(c.accepted + c.queued) FROM {TABLE} c WHERE c.lane = t.name), 0)",
        "running_now": f"COALESCE((SELECT SUM(c.dispatched + c.in_flight) FROM {TABLE} c WHERE c.lane = t.name), 0)",
        "oldest_accepted_at": oldest(State.ACCEPTED), "oldest_queued_at": oldest(State.QUEUED),
    }
    params = [(None, name) for name in names]
    if also is not None:
        extra[also[0]] = also[1]  # the last column: its parameters come before the condition's
        params = [*also[2], *params]
    found = {}
    for lane in select(Lane, f"t.name IN ({', '.join(['%s'] * len(names))})", params, extra=extra):
        moments = (moment(lane.oldest_accepted_at), moment(lane.oldest_queued_at))
        lane.oldest_waiting_at = min((t for t in moments if t), default=None)
        lane.waiting_now, lane.running_now = int(lane.waiting_now), int(lane.running_now)
        found[lane.pk] = lane
    return found
