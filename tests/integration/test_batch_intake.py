"""POST /api/v1/tasks/batch: up to 500 submissions in one request, each accepted, replayed or
refused on its own (with the problem code a single submission would get), never half written."""

from __future__ import annotations

import json

import pytest

from tasks.models import Task, TaskEvent, TenantQuota
from tasks.poc import files

pytestmark = pytest.mark.django_db(transaction=True)


def upload(api, content: bytes | None = None, name: str = "a.wav") -> str:
    answer = api.post("/api/v1/files", data=content or files.wav(), content_type="application/octet-stream", HTTP_X_FILENAME=name)
    assert answer.status_code == 201, answer.content
    return answer.json()["id"]


def batch(api, items):
    return api.post("/api/v1/tasks/batch", data=json.dumps({"items": items}), content_type="application/json")


def item(file_id: str, **extra):
    return {"file_id": file_id, "kind": "transcription", "target_format": "txt", **extra}


def test_each_item_is_accepted_or_refused_on_its_own_and_nothing_refused_is_stored(api, vendor):
    file_id = upload(api)
    answer = batch(api, [item(file_id, idempotency_key="k-1"), item(file_id, target_format="pdf"),
                         item("00000000-0000-0000-0000-000000000000"), item(file_id, priority="urgent"),
                         {"file_id": file_id, "kind": "transcription", "target_format": "txt", "colour": "red"},
                         item(file_id, idempotency_key="")])
    assert answer.status_code == 200, answer.content
    body = answer.json()
    statuses = [(r["index"], r["status"], r.get("code"), r.get("field")) for r in body["data"]]
    assert statuses == [(0, 202, None, None), (1, 400, "invalid_request", "target_format"), (2, 404, "file_not_found", None),
                        (3, 400, "invalid_request", "priority"), (4, 400, "invalid_request", "colour"),
                        (5, 400, "invalid_request", "idempotency_key")]
    assert (body["accepted"], body["replayed"], body["refused"]) == (1, 0, 5)
    accepted = body["data"][0]
    task = Task.objects.get()
    assert accepted["id"] == str(task.pk) and accepted["state"] == "ACCEPTED" and accepted["status_url"] == f"http://testserver/api/v1/tasks/{task.pk}"
    assert TaskEvent.objects.filter(task=task).count() >= 1
    assert api.get(f"/api/v1/tasks/{task.pk}").status_code == 200


def test_keys_replay_within_a_batch_and_across_batches_and_a_changed_item_is_a_mismatch(api, vendor):
    file_id = upload(api)
    first = batch(api, [item(file_id, idempotency_key="a"), item(file_id, idempotency_key="a"), item(file_id, idempotency_key="b")]).json()
    assert [r["status"] for r in first["data"]] == [202, 202, 202]
    assert [r.get("replayed") for r in first["data"]] == [False, True, False]
    assert first["data"][0]["id"] == first["data"][1]["id"] != first["data"][2]["id"]
    again = batch(api, [item(file_id, idempotency_key="b"), item(file_id, idempotency_key="a", target_format="srt")]).json()
    assert again["data"][0]["replayed"] is True and again["data"][0]["id"] == first["data"][2]["id"]
    assert (again["data"][1]["status"], again["data"][1]["code"]) == (422, "idempotency_key_mismatch")
    assert sorted(Task.objects.values_list("idempotency_key", flat=True)) == ["a", "b"]
    single = api.post("/api/v1/tasks", data=json.dumps(item(file_id)), content_type="application/json", HTTP_IDEMPOTENCY_KEY="a")
    assert single.status_code == 202 and single.json()["id"] == first["data"][0]["id"], "one key space for both ways in"


def test_quotas_hold_item_by_item(api, tenant, vendor):
    TenantQuota.objects.filter(tenant=tenant).update(submissions_per_minute=2)
    file_id = upload(api)
    body = batch(api, [item(file_id) for _ in range(4)]).json()
    assert [r["status"] for r in body["data"]] == [202, 202, 429, 429]
    assert {r["code"] for r in body["data"][2:]} == {"over_quota"}
    assert Task.objects.count() == 2


@pytest.mark.parametrize("payload,says", [
    ({"items": []}, "items"), ({"items": "x"}, "items"), ({}, "items"), ({"items": [{}] * 501}, "items"),
    ({"items": [item("f")], "extra": 1}, "extra"),
])
def test_a_batch_that_is_not_one_is_refused_whole(api, payload, says):
    answer = api.post("/api/v1/tasks/batch", data=json.dumps(payload), content_type="application/json")
    assert answer.status_code == 400 and answer["Content-Type"] == "application/problem+json", answer.content
    assert answer.json()["code"] == "invalid_request" and answer.json().get("field") == says, answer.json()
    assert Task.objects.count() == 0


def test_the_batch_is_in_the_openapi_document(api):
    document = api.get("/api/v1/openapi.json").json()
    operation = document["paths"]["/api/v1/tasks/batch"]["post"]
    assert operation["operationId"] == "submitTaskBatch" and "200" in operation["responses"]


def test_two_batches_racing_with_the_same_keys_make_one_task_per_key(vendor, tenant, token):
    """Two business systems (or a retried request) send the same batch at once: each key ends as
    one task, and both answers name it (one accepted it, the other replays it)."""
    import threading

    from django.db import connection
    from django.test import Client

    first = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    file_id = upload(first)
    items = [item(file_id, idempotency_key=f"race-{i}") for i in range(40)]
    answers: list = [None, None]

    def send(slot: int) -> None:
        try:
            answers[slot] = batch(Client(HTTP_AUTHORIZATION=f"Bearer {token}"), items).json()
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert Task.objects.count() == 40
    for index in range(40):
        a, b = answers[0]["data"][index], answers[1]["data"][index]
        statuses = sorted([(a["status"], a.get("replayed")), (b["status"], b.get("replayed"))])
        assert a.get("id") == b.get("id") or 409 in (a["status"], b["status"]), (a, b)
        assert statuses in ([(202, False), (202, True)], [(202, False), (409, None)]), statuses


def _redis_pushes() -> int:
    """RPUSH commands the Redis server has run (its own count)."""
    from django_q.brokers import get_broker

    return int(get_broker().connection.info("commandstats").get("cmdstat_rpush", {}).get("calls", 0))


def test_a_batch_sends_each_accepted_task_one_precheck_message_on_its_lane(api, vendor):
    """Every accepted item's pre-check is triggered once, on the workers of its lane; with the
    embedded broker a lane's messages are written in one statement with the tasks (on SQLite all
    the batch's in one)."""
    from django.conf import settings
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django_q.brokers import get_broker
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    from tasks.queueing import queue_backlog

    file_id = upload(api)
    before = {lane: queue_backlog(lane) for lane in ("interactive", "batch")}
    pushes = _redis_pushes() if settings.REDIS_URL else 0
    items = [item(file_id, priority="interactive" if i % 3 == 0 else "batch") for i in range(9)] + [item("nope")]
    with CaptureQueriesContext(connection) as statements:
        answer = batch(api, items)
    assert answer.status_code == 200 and answer.json()["accepted"] == 9, answer.content
    tasks = {lane: set(Task.objects.filter(lane_id=lane).values_list("pk", flat=True)) for lane in ("interactive", "batch")}
    assert {lane: len(ids) for lane, ids in tasks.items()} == {"interactive": 3, "batch": 6}
    assert {lane: queue_backlog(lane) - before[lane] for lane in tasks} == {"interactive": 3, "batch": 6}
    everyone = set().union(*tasks.values())
    entries = TaskEvent.objects.filter(task_id__in=everyone)
    assert sorted(entries.values_list("to_state", "generation")) == [("ACCEPTED", 0)] * 9
    assert {entry.task_id for entry in entries} == everyone
    if settings.REDIS_URL:
        # Redis: after the commit, one RPUSH a lane (one round trip), not one a task.
        assert _redis_pushes() - pushes == 2
        payloads = {lane: get_broker(lane).connection.lrange(get_broker(lane).list_key, before[lane], -1) for lane in tasks}
    else:
        inserts = [q["sql"] for q in statements.captured_queries if q["sql"].startswith('INSERT INTO "django_q_ormq"')]
        # SQLite: the batch's messages in one statement, as its tasks' history entries; else one a lane.
        assert len(inserts) == (1 if connection.vendor == "sqlite" else 2), inserts
        if connection.vendor == "sqlite":
            entries = [q for q in statements.captured_queries if q["sql"].startswith('INSERT INTO "tasks_taskevent"')]
            assert len(entries) == 1
        payloads = {lane: OrmQ.objects.filter(key=get_broker(lane).list_key).values_list("payload", flat=True)
                    for lane in tasks}
    for lane, ids in tasks.items():
        messages = [SignedPackage.loads(payload) for payload in payloads[lane]]
        assert sorted((m["func"], m["args"][0], m["args"][2]) for m in messages) == [("tasks.workers.run_step", "precheck", 0)] * len(ids)
        assert {m["args"][1] for m in messages} == {str(pk) for pk in ids}
        assert all(m["timeout"] and m["cluster"] == lane for m in messages)


def test_a_batch_is_accepted_while_the_redis_broker_is_unreachable_and_its_triggers_are_left_to_the_dispatcher(
        api, vendor, settings, monkeypatch):
    """Its tasks committed, a batch whose lanes' broker cannot be reached loses the triggers only:
    every task is marked unsent (the dispatcher sends them on its next pass), none is lost."""
    from tasks import queueing

    dead = "redis://127.0.0.1:1/0?socket_connect_timeout=1&socket_timeout=1"  # nothing listens on port 1
    settings.Q_CLUSTER = {**{k: v for k, v in settings.Q_CLUSTER.items() if k != "orm"}, "redis": dead}
    monkeypatch.setattr("django_q.conf.Conf.REDIS", dead)
    monkeypatch.setattr("django_q.conf.Conf.ORM", None)
    monkeypatch.setattr("django_q.conf.Conf.BROKER_CLASS", None)
    monkeypatch.setattr(queueing, "_brokers", {})
    monkeypatch.setattr(queueing, "_unreachable_until", {})  # what this test learns stays in it
    file_id = upload(api)
    answer = batch(api, [item(file_id, priority="interactive" if i % 2 else "batch") for i in range(6)])
    assert answer.status_code == 200 and answer.json()["accepted"] == 6, answer.content
    assert Task.objects.count() == 6
    assert sorted(Task.objects.values_list("state", "enqueued_at")) == [("ACCEPTED", None)] * 6


def test_a_batch_of_several_files_with_keys_repeated_across_them_answers_each_key_as_one(api, vendor):
    """Keys repeated across the items of several files: each key is one task, replayed or a
    mismatch item by item. PostgreSQL reads the batch's files in the statement that tries its keys'
    locks, each key tried once however many files and items."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    first, second = upload(api), upload(api, files.wav(3))
    items = [item(first, idempotency_key="x"), item(second, idempotency_key="y"), item(first, idempotency_key="x"),
             item(second, idempotency_key="y", target_format="srt"), item(second, idempotency_key="x")]
    with CaptureQueriesContext(connection) as statements:
        answer = batch(api, items).json()
    assert [(r["status"], r.get("replayed"), r.get("code")) for r in answer["data"]] == [
        (202, False, None), (202, False, None), (202, True, None), (422, None, "idempotency_key_mismatch"),
        (422, None, "idempotency_key_mismatch")]
    assert answer["data"][0]["id"] == answer["data"][2]["id"] != answer["data"][1]["id"]
    assert sorted(Task.objects.values_list("idempotency_key", flat=True)) == ["x", "y"]
    if connection.vendor == "postgresql":
        tried = [q["sql"] for q in statements.captured_queries if "pg_try_advisory_xact_lock" in q["sql"]]
        assert len(tried) == 1 and "tasks_fileversion" in tried[0], tried
        assert tried[0].count("pg_try_advisory_xact_lock") == 2, tried
