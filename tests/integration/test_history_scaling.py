"""The cost of a task must not grow with the installation's history: every statement a task's way
runs (its submission, the dispatcher's passes, its steps, the periodic sweeps) reads the tables
that keep every finished task's rows through an index, never by scanning them.

A benchmark on a fresh database cannot see this (admission once read every budget slot ever
released: 0.06 ms a pass on a new installation, 25 ms after 100,000 tasks, under its lock). The
query plans can: SQLite's EXPLAIN QUERY PLAN says SCAN for a table read whole. (PostgreSQL plans a
sequential scan of a small table whatever its indexes, so its plans say nothing on a test database.)
"""

from __future__ import annotations

import re

import pytest
from django.db import connection

from tests.conftest import run_until
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)

# Tables that keep rows for every task that ever ran.
GROWING = ("tasks_task", "tasks_taskevent", "tasks_budgetslot", "tasks_vendorjob", "tasks_vendorcall",
           "tasks_attempt", "tasks_notification", "tasks_fileversion", "tasks_idempotencyrecord",
           "tasks_deadletter", "tasks_quarantine", "tasks_duplicateincident")
_SCAN = re.compile(r"\bSCAN (\w+)(?: AS \w+)?(?: USING (?:COVERING )?INDEX (\w+))?")


def _scans(plan: list[str], partial: set[str]) -> list[str]:
    """The growing tables a plan reads whole: a SCAN of the table, or of a whole index of it,
    unless the index is partial (it holds only the live rows, such as the jobs not yet ended)."""
    found = []
    for step in plan:
        match = _SCAN.search(step)
        if match and match.group(1) in GROWING and match.group(2) not in partial:
            found.append(step)
    return found


def _captured(run) -> dict[str, tuple]:
    statements: dict[str, tuple] = {}

    def spy(execute, sql, params, many, context):
        if not many and sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "INSERT", "WITH")):
            statements.setdefault(sql, params)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        run()
    return statements


def _plan(sql: str, params: tuple) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN QUERY PLAN {sql}", params)
        return [row[-1] for row in cursor.fetchall()]


def _scanned(statements: dict[str, tuple]) -> dict[str, list[str]]:
    scanned = {}
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql LIKE '% WHERE %'")
        partial = {row[0] for row in cursor.fetchall()}
        for sql, params in statements.items():
            cursor.execute(f"EXPLAIN QUERY PLAN {sql}", params)
            steps = _scans([row[-1] for row in cursor.fetchall()], partial)
            if steps:
                scanned[sql] = steps
    return scanned


def test_every_statement_of_a_tasks_way_reads_the_growing_tables_by_index(inline_queue, api):
    if connection.vendor != "sqlite":
        pytest.skip("read from SQLite's plans (PostgreSQL scans a test database's small tables anyway)")
    from tasks.services.dispatch import tick
    from tasks.services.housekeeping import housekeeping, remove_orphan_results

    def way() -> None:
        task = run_until(submit_file(api))
        assert task.state == "SUCCEEDED"
        tick(full=True)  # every pass of the dispatcher, with nothing due

    statements = _captured(way)
    assert len(statements) > 30, "the task's way was not captured"
    scanned = _scanned(statements)
    assert not scanned, "\n".join(f"{sql[:200]}\n    {steps}" for sql, steps in scanned.items())
    # The sweeps every ten minutes read no table whole either. The orphan-results sweep is made to
    # find its results old enough (they are a moment old): it checks them by their tasks' keys.
    sweeps = {**_captured(housekeeping), **_captured(lambda: remove_orphan_results(older_than_s=0))}
    assert any('"tasks_quarantine"."expires_at" <' in sql for sql in sweeps), "the quarantine sweep did not run"
    assert any('"tasks_task"."result_path"' in sql and '"tasks_task"."id" IN' in sql for sql in sweeps), \
        "the orphan-results sweep did not check a result"
    assert any("tasks_ledgerentry" in sql and "checked_at" in sql for sql in sweeps), "the ledger check did not run"
    # An index range of the state SUCCEEDED is not a scan to SQLite, but it holds every task that
    # ever succeeded: the results past retention are read by each tenant's kept results instead.
    expiring = [sql for sql in sweeps if '"tasks_task"."finished_at" <' in sql and "result_path" in sql]
    assert expiring and all("task_result_kept" in " ".join(_plan(sql, sweeps[sql])) for sql in expiring), expiring
    swept = _scanned(sweeps)
    assert not swept, "\n".join(f"{sql[:200]}\n    {steps}" for sql, steps in swept.items())


def test_the_dispatchers_question_is_planned_for_its_values_at_every_tick():
    """PostgreSQL: the one statement a tick asks first (which passes have rows) finds them through
    partial indexes, by a state and a moment, which a prepared statement's generic plan cannot
    use: kept prepared on the dispatcher's connection, it read the task table's whole history at
    every tick (measured in the benchmark: 200-800 ms a tick over 100,000 finished tasks, against
    10-15 ms planned for its values). The connection prepares what it runs again; not this."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite prepares nothing across statements")
    from tasks.models import Task
    from tasks.services import dispatch

    for _ in range(6):
        dispatch.tick()
        Task.objects.filter(state="RUNNING").exists()  # a statement run again, to show preparing is on

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    assert any('"tasks_task"."state" = ' in sql and "EXISTS" not in sql for sql in prepared), prepared
    assert not [sql for sql in prepared if sql.startswith("SELECT EXISTS (")]
