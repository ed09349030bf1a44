"""A lane's backlog must not be read whole to find its first waiting tasks: intake asks for the
oldest waiting task on every submission (the lane's gate), admission for each tenant's heads on
every pass. Both must read the first rows of an index range, however many tasks wait.

Asked of the databases' own plans with a backlog large enough that PostgreSQL plans by its
indexes: PostgreSQL's EXPLAIN ANALYZE says how many rows each read of the task table returned or
filtered out; SQLite's plan says whether it sorted (a TEMP B-TREE) or read the table whole.
"""

from __future__ import annotations

import contextlib
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


def _statistics(settled: bool) -> None:
    """PostgreSQL: the task table's statistics as a settled installation has them (autovacuum has
    analyzed the table), or none, as a fresh installation meets its first backlog (not those an
    earlier test left: they describe other rows). Forgetting them takes a superuser, as the tests'
    database user is here and in CI."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        if settled:
            cursor.execute("ANALYZE tasks_task")
        else:
            cursor.execute("DELETE FROM pg_statistic WHERE starelid = 'tasks_task'::regclass")
            cursor.execute("UPDATE pg_class SET reltuples = -1, relpages = 0 WHERE oid = 'tasks_task'::regclass")


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
        _statistics(settled)
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


def test_a_submissions_keys_are_looked_up_by_key_not_among_the_tenants_tasks():
    """Every submission with an Idempotency-Key asks which tasks already hold its keys (several at
    once for a group commit or a batch). The tenant's backlog must not be read to answer: on a
    fresh PostgreSQL installation (no statistics yet) a lookup of several keys was planned as a
    read of all the tenant's tasks filtered by key, 10 ms for a batch's keys at 27,000 tasks."""
    from tasks.services.intake import _Lanes, _tasks_by_key

    acme, _ = _backlog()
    held = list(Task.objects.filter(tenant=acme).order_by("created_at")[:3])
    for index, task in enumerate(held):
        Task.objects.filter(pk=task.pk).update(idempotency_key=f"held-{index}")
    with connection.cursor() as cursor:  # the tenant's other tasks hold keys too, as submissions through the API do
        cursor.execute("UPDATE tasks_task SET idempotency_key = 'other-' || created_at WHERE tenant_id = %s "
                       "AND idempotency_key IS NULL", [acme.pk.hex if connection.vendor == "sqlite" else acme.pk])
    for keys in (["held-0", "new-0"], ["held-1", "held-2", "new-1"], [f"new-{i}" for i in range(100)] + ["held-0"]):
        found = {}

        def read(keys=keys, found=found) -> None:
            found["lanes"] = _Lanes(["batch"], holders_of=(acme, keys)).holders
            found["alone"] = _tasks_by_key(acme, keys)

        for settled in (False, True) if connection.vendor == "postgresql" else (False,):
            _statistics(settled)
            for sql, params in _statements(read):
                if connection.vendor == "postgresql":
                    rows = _task_rows_read(sql, params)
                    assert rows <= 2 * len(keys) + 2 * HEADS, f"{rows} rows of the task table read for {len(keys)} keys:\n{sql}"
                else:
                    assert not _sorted_or_scanned(sql, params), sql
            wanted = {key: pk for key, pk in ((f"held-{i}", t.pk) for i, t in enumerate(held)) if key in keys}
            assert {key: task.pk for key, task in found["lanes"].items()} == wanted
            assert {key: task.pk for key, task in found["alone"].items()} == wanted
    if connection.vendor == "postgresql":
        # Asked again and again, several keys are still planned for their values each time: no plan
        # of theirs is kept on the connection (one made while the table was small would stay).
        for _ in range(8):
            _Lanes(["batch"], holders_of=(acme, ["held-0", "new-0"]))
            _tasks_by_key(acme, ["held-0", "new-0"])
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements WHERE statement LIKE %s "
                           "AND statement NOT LIKE %s", ["%unnest(%", "EXPLAIN%"])  # (not the plans this test asked for)
            assert cursor.fetchall() == []
            cursor.execute("SELECT count(*) FROM pg_prepared_statements")
            assert cursor.fetchone()[0] > 0, "nothing is prepared on this connection: the check above says nothing"


def _counters_reported() -> None:
    """PostgreSQL: this connection's writes counted in pg_stat_user_tables now (a backend reports
    them about once a second otherwise)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


@contextlib.contextmanager
def _autovacuum_off():
    """PostgreSQL: no ANALYZE of the task table but the test's own (autovacuum's would race it)."""
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE tasks_task SET (autovacuum_enabled = false)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE tasks_task RESET (autovacuum_enabled)")


def _described_rows() -> float:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = 'tasks_task'::regclass")
        return cursor.fetchone()[0]


@pytest.fixture
def young_backlog():
    """PostgreSQL: a backlog in a task table never analyzed (a new installation's), its writes
    counted, and no ANALYZE of it but the test's own while the test runs."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite plans by its indexes' shapes and is never analyzed")
    with _autovacuum_off():
        _statistics(False)
        _backlog()
        _counters_reported()
        assert _described_rows() < 0  # never analyzed: the planner guesses from the table's pages
        yield


def test_a_young_task_table_that_outgrew_its_statistics_is_analyzed_by_the_dispatcher(young_backlog, monkeypatch,
                                                                                      caplog):
    """A new installation's first backlog would otherwise be planned without statistics until
    autovacuum's first pass (at most once a minute): the dispatcher's pass analyzes the tables that
    changed by as many rows as their statistics describe, and then leaves them alone."""
    from tasks import table_statistics
    from tests.support.flows import logged

    monkeypatch.setattr(table_statistics, "_last_asked", 0.0)
    with caplog.at_level("INFO", logger="sluice"):
        counts = dispatch.tick(full=True)
    assert counts["statistics"] >= 1
    assert _described_rows() == BACKLOG
    refreshed = logged(caplog, "statistics_refreshed")
    assert refreshed and "tasks_task" in refreshed[0]["reason"].split(",")

    # Asked again at once: nothing changed since, nothing is analyzed (and a pass sooner than
    # STATISTICS_EVERY_S after the last does not ask).
    _counters_reported()
    assert "tasks_task" not in table_statistics.statistics_refresh()
    assert dispatch.tick(full=True)["statistics"] == 0

    # Every task moved on (as a burst's tasks do): as many rows changed as it held, analyzed again.
    Task.objects.update(state=State.SUCCEEDED)
    _counters_reported()
    assert "tasks_task" in table_statistics.statistics_refresh()


def test_the_statistics_pass_leaves_alone_the_tables_its_database_user_may_not_analyze(young_backlog):
    """A database user that neither owns Sluice's tables nor the database (nor is a superuser)
    would only be warned and skipped by ANALYZE, at every pass: it does not ask."""
    import uuid

    from tasks import table_statistics

    assert any(t.name == "tasks_task" and t.needs_statistics() for t in table_statistics.table_growth())
    role = f"sluice_reader_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} NOLOGIN")
        cursor.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET ROLE {role}")
        assert not [t.name for t in table_statistics.table_growth() if t.name.startswith("tasks_")]
        assert table_statistics.statistics_refresh() == []
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
            cursor.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
            cursor.execute(f"DROP ROLE {role}")
    assert _described_rows() < 0  # nothing was analyzed


def test_a_statistics_pass_that_fails_is_logged_and_asked_again_at_the_next_pass(young_backlog, monkeypatch, caplog):
    """The pass runs inside the dispatcher's tick: an ANALYZE the database cancels (here by the
    statement timeout an installation may set for its database user) is a warning, not the
    tick's failure."""
    from tasks import table_statistics
    from tests.support.flows import logged

    monkeypatch.setattr(table_statistics, "_last_asked", 0.0)
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '1ms'")
    try:
        with caplog.at_level("INFO", logger="sluice"):
            assert table_statistics.statistics_refresh_due() == []
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET statement_timeout")
    failed = logged(caplog, "statistics_refresh_failed")
    assert failed and failed[0]["exception"] == "OperationalError"  # Django's name for QueryCanceled
    assert _described_rows() < 0
    monkeypatch.setattr(table_statistics, "_last_asked", 0.0)  # the next pass, STATISTICS_EVERY_S later
    assert "tasks_task" in table_statistics.statistics_refresh_due()
