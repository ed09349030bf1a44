"""A lane's backlog must not be read whole to find its first waiting tasks: intake asks for the
oldest waiting task on every submission (the lane's gate), admission for each tenant's heads on
every pass. Both must read the first rows of an index range, however many tasks wait.

Asked of the databases' own plans with a backlog large enough that PostgreSQL plans by its
indexes: PostgreSQL's EXPLAIN ANALYZE says how many rows each read of the task table returned or
filtered out; SQLite's plan says whether it sorted (a TEMP B-TREE) or read the table whole.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from tasks.counters import lanes_with_load
from tasks.models import FileVersion, Lane, Task
from tasks.services import dispatch
from tasks.services.tenancy import tenant_ensure
from tasks.states import State

pytestmark = pytest.mark.django_db(transaction=True)

BACKLOG = 3000  # waiting in one lane, half pre-checked and queued, half still ACCEPTED
HEADS = 5


def _backlog() -> list:
    now = timezone.now()
    tenants = [tenant_ensure(name="acme"), tenant_ensure(name="globex")]
    files = {t.pk: FileVersion.objects.create(tenant=t, sha256="a" * 64, size=10, detected_type="audio/x-wav",
                                              storage_name=f"x/{t.name}") for t in tenants}
    rows = []
    for index in range(BACKLOG):
        tenant = tenants[index % 2]
        queued = index % 4 < 2
        # Deadlines in no order of creation, some none (they come last in admission's order).
        deadline = None if index % 7 == 0 else now + timedelta(seconds=(index * 7919) % 5000)
        rows.append(Task(
            tenant=tenant, file=files[tenant.pk], kind="transcription", target_format="txt", lane_id="batch",
            state=State.QUEUED if queued else State.ACCEPTED, created_at=now - timedelta(seconds=BACKLOG - index),
            queued_at=now - timedelta(seconds=BACKLOG - index) if queued else None,
            deadline_at=now + timedelta(hours=1), queue_deadline_at=now + timedelta(hours=1),
            dispatch_deadline_at=deadline))
    Task.objects.bulk_create(rows, batch_size=500)
    return tenants


def _statements(read, *, some: bool = True) -> list[tuple[str, tuple]]:
    captured = []

    def spy(execute, sql, params, many, context):
        captured.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        read()
    statements = [(sql, params) for sql, params in captured if "tasks_task" in sql]
    assert statements or not some, "nothing read the task table"
    return statements


def _task_rows_read(sql: str, params: tuple) -> int:
    """PostgreSQL: the task table's rows the statement's reads returned or filtered out."""
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node: dict) -> int:
        own = 0
        if node.get("Relation Name") == "tasks_task":
            own = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        return own + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan[0]["Plan"])


def _sorted_or_scanned(sql: str, params: tuple) -> list[str]:
    """SQLite: the plan's steps that sort the rows found or read the task table whole (by any of its aliases)."""
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN QUERY PLAN {sql}", params)
        steps = [row[-1] for row in cursor.fetchall()]
    names = {"tasks_task", *re.findall(r'\btasks_task"?\s+(?:AS\s+)?"?(\w+)', sql)}
    return [step for step in steps if "TEMP B-TREE" in step or (step.startswith("SCAN ") and step.split()[1] in names)]


def _reads_only_the_first_rows(read) -> None:
    for sql, params in _statements(read):
        if connection.vendor == "postgresql":
            rows = _task_rows_read(sql, params)
            assert rows <= 4 * HEADS, f"{rows} rows of the task table read for the first ones of the backlog:\n{sql}"
        else:
            steps = _sorted_or_scanned(sql, params)
            assert not steps, f"{steps}\n{sql}"


def test_the_first_waiting_tasks_of_a_long_backlog_are_read_without_reading_the_backlog():
    acme, globex = _backlog()
    lane = Lane.objects.get(pk="batch")
    waiting = list(Task.objects.filter(lane=lane, state=State.QUEUED, dispatched_at__isnull=True))
    far = timezone.now() + timedelta(days=3650)

    def admission_order(task: Task) -> tuple:
        return (task.dispatch_deadline_at is None, task.dispatch_deadline_at or far, task.queued_at, task.created_at)

    # What is read is what admission and the gate weigh (the order is the index's, not a sort's).
    # (Asked for one tenant, admission reads the lane's heads: it asks so when only one waits.)
    heads = dispatch._waiting_heads(lane, [acme.pk], HEADS)[acme.pk]
    assert [t.pk for t in heads] == [t.pk for t in sorted(waiting, key=admission_order)[:HEADS]]
    both = dispatch._waiting_heads(lane, [acme.pk, globex.pk], HEADS)
    assert [t.pk for t in both[globex.pk]] == [t.pk for t in sorted((t for t in waiting if t.tenant_id == globex.pk),
                                                                    key=admission_order)[:HEADS]]
    gate = lanes_with_load(["batch"])["batch"]
    oldest = Task.objects.filter(lane=lane, state__in=[State.ACCEPTED, State.QUEUED]).order_by("created_at").first()
    assert gate.oldest_waiting_at == oldest.created_at

    # As a fresh installation meets its first backlog (no statistics yet) and, on PostgreSQL, as a
    # settled one does (autovacuum has analyzed the table). Sluice never analyzes a SQLite database,
    # and statistics left in it would change the plans every later test reads.
    for settled in (False, True) if connection.vendor == "postgresql" else (False,):
        if settled:
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE tasks_task")
        _reads_only_the_first_rows(lambda: lanes_with_load(["batch"]))
        _reads_only_the_first_rows(lambda: dispatch._waiting_heads(lane, [acme.pk], HEADS))
        _reads_only_the_first_rows(lambda: dispatch._waiting_heads(lane, [acme.pk, globex.pk], HEADS))


def test_a_dispatcher_tick_asks_what_is_due_without_reading_the_backlog():
    """Every dispatcher runs a tick many times a second: its first statement asks each pass
    whether it has anything to do. With a long backlog waiting and nothing else due, no pass's
    question may read the backlog to answer no."""
    _backlog()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE tasks_task")
    now = timezone.now()
    backlog_read = []
    for name, (probe, _) in dispatch._FULL_PASSES.items():
        asked = _statements(lambda: dispatch._which_have_rows({name: (probe, now)}), some=False)  # noqa: B023 (called here)
        for sql, params in asked:
            if connection.vendor == "postgresql":
                rows = _task_rows_read(sql, params)
                if rows > 4 * HEADS:
                    backlog_read.append(f"{name}: {rows} rows of the task table read:\n{sql}")
            elif _sorted_or_scanned(sql, params):
                backlog_read.append(f"{name}: {_sorted_or_scanned(sql, params)}\n{sql}")
    assert not backlog_read, "\n".join(backlog_read)
