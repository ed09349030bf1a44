"""Migrations keep the system writing while they run: on PostgreSQL an index added to a table
that already holds rows is built (and an old one dropped) CONCURRENTLY, since a plain CREATE INDEX
blocks every write to the table — task moves, admissions, uploads — for the length of the build."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db import connection
from django.db.migrations.loader import MigrationLoader

# Migrations before this one were written before the rule (they are applied already everywhere).
ONLINE_SINCE = "0017"

pytestmark = pytest.mark.django_db


def _statements(loader: MigrationLoader, key: tuple[str, str]) -> list[str]:
    migration = loader.disk_migrations[key]
    state = loader.project_state(key, at_end=False)
    with connection.schema_editor(collect_sql=True, atomic=False) as editor:
        migration.apply(state, editor, collect_sql=True)
    return editor.collected_sql


@pytest.mark.skipif(not settings.DATABASE_URL, reason="CONCURRENTLY is PostgreSQL's (run with DATABASE_URL; make test does)")
def test_indexes_on_existing_tables_are_built_and_dropped_concurrently_on_postgresql():
    loader = MigrationLoader(connection)
    checked = 0
    for key in sorted(k for k in loader.disk_migrations if k[0] == "tasks" and k[1][:4] >= ONLINE_SINCE):
        statements = _statements(loader, key)
        created = {m.group(1) for s in statements if (m := re.match(r'CREATE TABLE "(\w+)"', s))}
        for sql in statements:
            index = re.match(r'(CREATE (?:UNIQUE )?INDEX|DROP INDEX)\b(?: CONCURRENTLY)?.*?(?: ON "(\w+)")?', sql)
            if index is None or (index.group(2) or "") in created:
                continue
            checked += 1
            assert "CONCURRENTLY" in sql, f"{key[1]}: {sql}"
            assert not loader.disk_migrations[key].atomic, f"{key[1]} builds an index concurrently: atomic = False"
    assert checked >= 8, "the migrations since the rule add indexes: the check must have read them"


@pytest.mark.django_db(transaction=True)  # SQLite's schema editor cannot open inside a test's transaction
def test_dropping_a_fields_own_index_drops_only_that_index():
    """Migration 0024 takes away the own indexes of the task's tenant, lane, channel, vendor job
    and billing audit, and of the idempotency record's tenant. Django's AlterField would rebuild
    the whole table on SQLite (copy, drop, rename), and dropping the table drops the triggers that
    keep the lane and tenant counters: only DROP INDEX statements may run, and the indexes they
    name must be the ones Django created (a wrong name would be skipped by IF EXISTS)."""
    loader = MigrationLoader(connection)
    statements = _statements(loader, ("tasks", "0024_lean_task_indexes"))
    assert [sql for sql in statements if sql.startswith("DROP INDEX")], statements
    assert not [sql for sql in statements if re.search(r"\b(TABLE|TRIGGER)\b", sql)], statements
    with connection.cursor() as cursor:
        present = {table: set(connection.introspection.get_constraints(cursor, table))
                   for table in ("tasks_task", "tasks_idempotencyrecord")}
        gone = {("tasks_task", column) for column in ("tenant_id", "lane_id", "channel_id", "vendor_job_id",
                                                       "billing_audit_due_at")} | {("tasks_idempotencyrecord", "tenant_id")}
        with connection.schema_editor(collect_sql=True, atomic=False) as editor:
            left = {(table, column, suffix) for table, column in gone for suffix in ("", "_like")
                    if editor._create_index_name(table, [column], suffix=suffix) in present[table]}
        assert not left, f"indexes 0024 was to drop are still there: {left}"
        assert {"task_channel", "task_vendor_job", "task_billing_audit_due", "task_started", "task_lease_held"} \
            <= present["tasks_task"]
        # And the counters' triggers are still there (tasks/counters.py).
        if connection.vendor == "postgresql":
            cursor.execute("SELECT tgname FROM pg_trigger WHERE tgrelid = 'tasks_task'::regclass AND NOT tgisinternal")
            expected = {"task_counts"}
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'tasks_task'")
            expected = {"task_counts_insert", "task_counts_update", "task_counts_delete"}
        assert expected <= {row[0] for row in cursor.fetchall()}


def test_reversed_the_keys_migration_writes_the_records_the_release_before_reads(api):
    """Migration 0026 reversed (a rollback to the release before it): each keyed task's key and
    fingerprint are written to a record again, where that release looks for them."""
    from importlib import import_module

    from django.apps import apps

    from tasks.models import IdempotencyRecord, Task
    from tests.support.flows import submit_file

    migration = import_module("tasks.migrations.0026_keys_on_the_task")
    keyed, _ = submit_file(api, key="order-9"), submit_file(api)
    # (What RunPython hands it: the registry and an editor on the connection it migrates.)
    migration.write_records(apps, SimpleNamespace(connection=connection))
    task = Task.objects.get(pk=keyed)
    assert list(IdempotencyRecord.objects.values_list("key", "fingerprint", "task_id")) == [
        ("order-9", task.idempotency_fingerprint, task.pk)]
    assert task.idempotency_fingerprint


@pytest.mark.django_db(transaction=True)  # SQLite's schema editor cannot open inside a test's transaction
def test_the_history_note_is_added_in_place_and_its_trigger_is_sqlites_alone():
    """Migration 0029 adds the task's `moves_note` without rebuilding the table (a rebuild on
    SQLite drops the counters' triggers) and, on SQLite, the trigger that writes a move's history
    entries from it (tasks/lifecycle.py); PostgreSQL writes them in the move's WITH."""
    from tasks.lifecycle import HISTORY_TRIGGER

    statements = [sql for sql in _statements(MigrationLoader(connection), ("tasks", "0029_history_with_moves"))
                  if not sql.startswith("--")]
    assert len(statements) == 1 and re.match(r'ALTER TABLE "tasks_task" ADD COLUMN "moves_note" text NULL', statements[0]), \
        statements
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT tgname FROM pg_trigger WHERE tgrelid = 'tasks_task'::regclass AND NOT tgisinternal")
            assert HISTORY_TRIGGER not in {row[0] for row in cursor.fetchall()}
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'tasks_task'")
            assert {HISTORY_TRIGGER, "task_counts_insert", "task_counts_update", "task_counts_delete"} \
                <= {row[0] for row in cursor.fetchall()}
