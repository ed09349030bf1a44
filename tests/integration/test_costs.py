"""Counted costs (the benchmark's statements and queue messages per task): every process of the
system counts what it executes, off unless SLUICE_COUNT_DIR is set."""

from __future__ import annotations

import time

import httpx
import pytest

from tasks import costs
from tasks.poc import files
from tasks.services.tenancy import tenant_ensure, token_issue

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_submission_to_a_running_server_is_counted_in_statements_and_queue_messages(tmp_path):
    from tasks.system import Stack

    folder = tmp_path / "costs"
    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_COUNT_DIR": str(folder)})
    token = token_issue(tenant=tenant_ensure(name="counted")).token
    try:
        url = stack.start_web(workers=1, threads=2)
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30, trust_env=False) as client:
            file_id = client.post("/api/v1/files", content=files.wav(1), headers={"Content-Type": "application/octet-stream"}).json()["id"]
            time.sleep(2 * costs.FLUSH_S + 0.2)
            before = costs.totals(folder)
            answer = client.post("/api/v1/tasks", json={"file_id": file_id, "kind": "transcription", "target_format": "txt"})
            assert answer.status_code == 202
            time.sleep(2 * costs.FLUSH_S + 0.2)
        after = costs.totals(folder)
    finally:
        stack.stop_all()
    assert after["queue_messages"] - before.get("queue_messages", 0) == 1, "intake sends the pre-check step, once"
    assert 5 <= after["statements"] - before.get("statements", 0) <= 60


def test_counting_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("SLUICE_COUNT_DIR", raising=False)
    costs.count("statements")
    assert costs.directory() is None and not list(tmp_path.iterdir())


def test_many_threads_counting_at_once_never_fail_what_they_count(tmp_path, monkeypatch):
    """A threaded web server counts from many threads: flushing at the same moment must not raise
    into the statement being counted (it did: FileNotFoundError, a 500 on submit)."""
    import threading

    monkeypatch.setenv("SLUICE_COUNT_DIR", str(tmp_path / "costs"))
    monkeypatch.setattr(costs, "FLUSH_S", 0.0)  # every count flushes: the race, as often as it can happen
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(300):
                costs.count("statements")
        except BaseException as error:  # noqa: BLE001 - the test looks for any
            errors.append(error)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    costs.flush()
    assert not errors, errors[:3]
    assert costs.totals(tmp_path / "costs")["statements"] >= 2400


def test_a_statement_is_counted_by_its_kind_never_by_its_values():
    assert costs.kind('SELECT "tasks_task"."id" FROM "tasks_task" WHERE "tasks_task"."tenant_id" = %s') == "SELECT tasks_task"
    assert costs.kind('INSERT INTO "tasks_taskevent" ("task_id") VALUES (%s)') == "INSERT INTO tasks_taskevent"
    assert costs.kind('UPDATE "tasks_task" SET "state" = %s WHERE ("tasks_task"."id" = %s)') == "UPDATE tasks_task"
    assert costs.kind('DELETE FROM "django_q_ormq" WHERE "id" = %s') == "DELETE FROM django_q_ormq"
    assert costs.kind('SAVEPOINT "s1_x1"') == "SAVEPOINT" and costs.kind("BEGIN") == "BEGIN"
    assert costs.kind('WITH moved AS (UPDATE "tasks_task" SET "generation" = ("tasks_task"."generation" + %s) '
                      'WHERE ("tasks_task"."id" = %s) RETURNING "id") INSERT INTO "tasks_taskevent" ("task_id") '
                      'SELECT moved."id" FROM moved') == "WITH INSERT INTO tasks_taskevent"
    # Its main part is the first outside the parentheses of its parts, whatever they hold.
    assert costs.kind('WITH moved AS (UPDATE "tasks_task" AS t SET "x" = %s RETURNING t."id"), '
                      'w0 AS (INSERT INTO "tasks_budgetslot" ("a") SELECT c0 FROM (VALUES (%s::integer)) AS v (c0)) '
                      'INSERT INTO "tasks_taskevent" ("task_id") SELECT moved."id" FROM moved') == \
        "WITH INSERT INTO tasks_taskevent"
    assert costs.kind('WITH moved AS (UPDATE "tasks_task" AS t SET "x" = %s RETURNING t."id"), '
                      'w0 AS (UPDATE "tasks_budgetslot" AS t SET "r" = %s WHERE EXISTS (SELECT 1 FROM moved)) '
                      'SELECT COUNT(*) FROM moved') == "WITH SELECT moved"
    assert costs.kind('(SELECT "c" FROM "tasks_budgetslot") UNION ALL (SELECT "c" FROM "tasks_vendorjob")') == \
        "SELECT tasks_budgetslot"
    # A literal in the text is not a kind of its own.
    assert costs.kind("SELECT 'secret-value' FROM \"tasks_task\"") == "SELECT tasks_task"
    # A long column list, and a subquery among the columns: the table is the statement's own FROM's.
    columns = ", ".join(f't."c{i}"' for i in range(80))
    assert costs.kind(f'SELECT {columns}, (SELECT SUM(c.n) FROM "tasks_lanetenantload" c WHERE c.lane = t.name) AS n '
                      f'FROM "tasks_lane" t WHERE t.name = %s') == "SELECT tasks_lane"
    # PostgreSQL's bulk insert reads from UNNEST: the table is the one inserted into.
    assert costs.kind('INSERT INTO "tasks_vendorcall" ("a", "b") SELECT * FROM UNNEST((%s)::integer[], (%s)::text[])') == \
        "INSERT INTO tasks_vendorcall"


def test_a_steps_vendor_calls_are_written_in_one_statement_without_a_transaction():
    """The log written after every step: one INSERT, no BEGIN/COMMIT around it; inside a caller's
    transaction (or too many for one statement) it is bulk_create's, and every row is written."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from tasks.models import VendorCall, VendorChannel
    from tasks.rows import insert_rows

    channel = VendorChannel.objects.first() or VendorChannel.objects.create(name="rows", base_url="http://127.0.0.1:1")
    calls = [VendorCall(channel=channel, operation="poll", outcome="ok", duration_ms=i) for i in range(3)]
    with CaptureQueriesContext(connection) as statements:
        insert_rows(calls)
    assert [q["sql"].split()[0] for q in statements.captured_queries] == ["INSERT"]
    with transaction.atomic():
        insert_rows([VendorCall(channel=channel, operation="poll", outcome="ok", duration_ms=9)])
    insert_rows([VendorCall(channel=channel, operation="poll", outcome="ok", duration_ms=10 + i) for i in range(500)])
    assert sorted(VendorCall.objects.filter(channel=channel).values_list("duration_ms", flat=True)) == [
        0, 1, 2, 9, *range(10, 510)]


def test_the_embedded_broker_acknowledges_a_message_in_one_statement():
    """django-q2's ORM broker deleted each acknowledged message in a transaction of its own."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.conf import settings
    from django_q.brokers import get_broker

    if settings.REDIS_URL:
        pytest.skip("the embedded broker's: with REDIS_URL the broker is Redis")
    broker = get_broker("sluice-ack-probe")
    assert type(broker).__name__ == "Orm"
    broker.enqueue("payload")
    (ack_id, payload), = broker.dequeue()
    assert payload == "payload"
    with CaptureQueriesContext(connection) as statements:
        broker.acknowledge(ack_id)
    assert [q["sql"].split()[0] for q in statements.captured_queries] == ["DELETE"]
    assert broker.queue_size() == 0 and broker.lock_size() == 0
