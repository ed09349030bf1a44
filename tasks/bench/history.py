"""An installation's history, for the benchmark: `count` finished tasks with every row a finished
task leaves (its history entries, attempt, budget slots, vendor job and vendor calls), copied from
one task the benchmark ran, in a few statements. The pipeline measured again on top of them says
whether a task's cost grows with the history (it must not: tests/integration/test_history_scaling.py
checks the plans; this measures the time).
"""

from __future__ import annotations

from typing import Any

from django.db import connection, transaction
from django.db.models import DateTimeField

from tasks.models import Attempt, BudgetSlot, Task, TaskEvent, VendorCall, VendorJob

# Copies get ids no real task can have (version 4 UUIDs have 4 in that place, these 0).
_PREFIX = "ffffffff-0000-0000-8000-"


def _new_id(number: str) -> str:
    """The id of copy `number` (an SQL expression), as the column stores UUIDs."""
    if connection.vendor == "postgresql":
        return f"('{_PREFIX}' || lpad(to_hex({number}), 12, '0'))::uuid"
    return f"('{_PREFIX.replace('-', '')}' || printf('%012x', {number}))"


def _earlier(column: str, seconds: str) -> str:
    """A timestamp column's value `seconds` (an SQL expression) earlier, as the column stores it."""
    if connection.vendor == "postgresql":
        return f"{column} - make_interval(secs => {seconds})"
    return f"strftime('%Y-%m-%d %H:%M:%f', {column}, '-' || ({seconds}) || ' seconds')"


def _columns(model: Any, replaced: dict[str, str], age: str) -> tuple[str, str]:
    """The model's columns (its automatic key left to the database) and what each copy takes: the
    template's value (`c.<column>`), its timestamps `age` seconds earlier, unless `replaced` gives
    an expression."""
    quote = connection.ops.quote_name
    names, values = [], []
    for field in model._meta.concrete_fields:
        if field.primary_key and field.attname not in replaced:
            continue
        names.append(quote(field.column))
        value = f"c.{quote(field.column)}"
        if isinstance(field, DateTimeField):
            value = _earlier(value, age)
        values.append(replaced.get(field.attname, value))
    return ", ".join(names), ", ".join(values)


def seed_finished_tasks(template: Task, count: int) -> int:
    """`count` copies of the finished `template` task and of its rows; returns the tasks written."""
    quote = connection.ops.quote_name
    numbers = f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {int(count)})"
    task_id = _new_id("n.i")
    copies = [
        (Task, {"id": task_id, "idempotency_key": "NULL", "vendor_client_ref": "'history-' || n.i"}, "id"),
        (TaskEvent, {"task_id": task_id}, "task_id"),
        (Attempt, {"task_id": task_id}, "task_id"),
        (BudgetSlot, {"task_id": task_id}, "task_id"),
        (VendorJob, {"task_id": task_id, "vendor_job_id": f"'history-' || n.i || '-' || c.{quote('id')}"}, "task_id"),
        (VendorCall, {"task_id": task_id}, "task_id"),
    ]
    with transaction.atomic(), connection.cursor() as cursor:
        for model, replaced, key in copies:
            # A task a second, the newest an hour before the template: a day's work for 86,400.
            names, values = _columns(model, replaced, age="3600 + n.i")
            cursor.execute(
                f"INSERT INTO {quote(model._meta.db_table)} ({names}) {numbers} "
                f"SELECT {values} FROM n CROSS JOIN {quote(model._meta.db_table)} c WHERE c.{quote(key)} = %s",
                [template.pk.hex if connection.vendor != "postgresql" else template.pk])
            if model is Task:
                written = cursor.rowcount
    # What happens to rows that arrive over a day, done at once for rows that arrived at once:
    # PostgreSQL's autovacuum vacuums and analyzes the tables as inserts accumulate (the planner's
    # statistics count the rows, their pages are marked all-visible; left undone, the insert-driven
    # autovacuum of the 100,000 rows and the first readers' hint-bit writes may land inside the
    # measured run, which a day's gradual growth would have spread out), SQLite
    # checkpoints its write-ahead log a thousand pages at a time (not hundreds of MB at the
    # pipeline's first commit).
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            for model, _, _ in copies:
                cursor.execute(f"VACUUM (ANALYZE) {quote(model._meta.db_table)}")
        else:
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return written
