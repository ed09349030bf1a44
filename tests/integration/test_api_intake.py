"""Intake through the tasks API: 202 means durable; bad input gets problem+json and stores nothing."""

import json
import uuid

import pytest

from tasks.models import FileVersion, IdempotencyRecord, Task, TaskEvent, Tenant
from tasks.poc import files
from tasks.services.tenancy import tenant_ensure, token_issue
from tests.support.flows import logged, stored_bytes

pytestmark = pytest.mark.django_db


def upload(api, content: bytes, name: str = "a.wav"):
    return api.post("/api/v1/files", data=content, content_type="application/octet-stream", HTTP_X_FILENAME=name)


def submit(api, body: dict, key: str | None = None):
    extra = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return api.post("/api/v1/tasks", data=json.dumps(body), content_type="application/json", **extra)


def test_upload_then_submit_answers_202_with_a_status_url_and_the_task_is_durable(api):
    stored = upload(api, files.wav())
    assert stored.status_code == 201
    body = stored.json()
    assert body["detected_type"] == "audio/x-wav" and body["size"] > 0 and len(body["sha256"]) == 64
    answer = submit(api, {"file_id": body["id"], "kind": "transcription", "target_format": "srt"})
    assert answer.status_code == 202
    # The same answer as every other of the API's (and as it was when ninja wrote it).
    assert answer["Content-Type"] == stored["Content-Type"] == "application/json; charset=utf-8"
    accepted = answer.json()
    assert accepted["state"] == "ACCEPTED" and answer["Location"] == accepted["status_url"]
    task = Task.objects.get(pk=accepted["id"])
    assert TaskEvent.objects.filter(task=task, to_state="ACCEPTED").exists()
    status = api.get(f"/api/v1/tasks/{task.pk}").json()
    assert status["state"] == "ACCEPTED" and status["kind"] == "transcription" and status["result"] is None


def test_the_stored_path_never_comes_from_the_filename(api):
    body = upload(api, files.text(), name="../../etc/passwd.txt").json()
    version = FileVersion.objects.get(pk=body["id"])
    assert "passwd" not in version.storage_name and ".." not in version.storage_name
    assert stored_bytes(version) == files.text()


def test_multipart_upload_is_accepted_too(api):
    from django.core.files.uploadedfile import SimpleUploadedFile

    answer = api.post("/api/v1/files", data={"file": SimpleUploadedFile("doc.pdf", files.pdf(2), "application/pdf")})
    assert answer.status_code == 201 and answer.json()["detected_type"] == "application/pdf"


@pytest.mark.parametrize(
    "headers,status,code",
    [({}, 401, "unauthenticated"), ({"HTTP_AUTHORIZATION": "Bearer slu_nope_nope"}, 401, "unauthenticated")],
)
def test_missing_or_unknown_token_is_401(client, headers, status, code):
    answer = client.get("/api/v1/tasks", **headers)
    assert answer.status_code == status
    assert answer["Content-Type"] == "application/problem+json" and answer.json()["code"] == code


def test_empty_file_is_refused_and_nothing_is_stored(api):
    answer = upload(api, b"")
    assert answer.status_code == 400 and answer.json()["code"] == "empty_file"
    assert FileVersion.objects.count() == 0


def test_file_over_the_limit_is_413_and_nothing_is_stored(api, settings):
    settings.MAX_UPLOAD_BYTES = 1000
    answer = upload(api, b"x" * 5000, name="big.txt")
    assert answer.status_code == 413 and answer.json()["code"] == "file_too_large"
    assert FileVersion.objects.count() == 0
    assert not any(p.is_file() for p in settings.FILES_DIR.rglob("*.partial"))


def test_images_are_unsupported_types(api):
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 100
    answer = upload(api, png, name="x.png")
    assert answer.status_code == 415 and answer.json()["code"] == "unsupported_type"


@pytest.mark.parametrize(
    "body,field",
    [
        ({"kind": "transcription", "target_format": "srt"}, "file_id"),
        ({"file_id": "F", "kind": "painting", "target_format": "srt"}, "kind"),
        ({"file_id": "F", "kind": "transcription", "target_format": "docx"}, "target_format"),
        ({"file_id": "F", "kind": "transcription", "target_format": "srt", "priority": "urgent"}, "priority"),
        ({"file_id": "F", "kind": "transcription", "target_format": "srt", "deadline_s": 1}, "deadline_s"),
        ({"file_id": "F", "kind": "transcription", "target_format": "srt", "callback_url": "ftp://x"}, None),
        ({"file_id": "F", "kind": "transcription", "target_format": "srt", "colour": "red"}, "colour"),
    ],
)
def test_invalid_submissions_name_what_to_fix_and_store_nothing(api, body, field):
    file_id = upload(api, files.wav()).json()["id"]
    body = {k: (file_id if v == "F" else v) for k, v in body.items()}
    answer = submit(api, body, key="k-invalid")
    assert answer.status_code == 400
    problem = answer.json()
    assert problem["code"] == "invalid_request" and problem["detail"]
    if field:
        assert problem["field"] == field
    assert Task.objects.count() == 0
    # A refusal does not burn the key: a valid request with it makes a task.
    fixed = submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}, key="k-invalid")
    assert fixed.status_code == 202 and not fixed.has_header("Idempotent-Replayed")


def test_malformed_json_is_a_problem_not_a_500(api):
    answer = api.post("/api/v1/tasks", data="{not json", content_type="application/json")
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_json"


def test_unknown_file_is_404_file_not_found(api):
    answer = submit(api, {"file_id": "00000000-0000-0000-0000-000000000000", "kind": "transcription", "target_format": "txt"})
    assert answer.status_code == 404 and answer.json()["code"] == "file_not_found"


def test_transcribing_a_pdf_is_refused_with_an_actionable_message(api):
    file_id = upload(api, files.pdf(), name="a.pdf").json()["id"]
    answer = submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"})
    assert answer.status_code == 400 and "audio" in answer.json()["detail"]


def test_same_key_same_request_replays_the_original_task(api):
    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt", "params": {"language": "en"}}
    first = submit(api, body, key="order-1")
    again = submit(api, {**body, "params": {"language": "en"}}, key="order-1")
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again["Idempotent-Replayed"] == "true"
    assert Task.objects.count() == 1


def test_a_keys_holder_is_read_with_the_lanes_load_in_one_statement(api):
    """A submission reads the task already holding its key in the statement that reads its lane's
    load, not in one of its own; a key held, and one held by no task, are told apart all the same."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt"}
    for expected in (False, True):  # a new key, then its replay
        with CaptureQueriesContext(connection) as statements:
            answer = submit(api, body, key="read-once")
        assert answer.status_code == 202 and (answer.get("Idempotent-Replayed") == "true") == expected
        reads = [q["sql"] for q in statements.captured_queries
                 if "idempotency_key IN" in q["sql"] or "idempotency_key = q.key" in q["sql"]]
        assert len(reads) == 1 and "tasks_lane" in reads[0], reads
    assert Task.objects.count() == 1


@pytest.mark.parametrize("change", [
    {"target_format": "srt"}, {"kind": "transcription", "target_format": "json"}, {"priority": "batch"},
    {"params": {"language": "de"}}, {"deadline_s": 7200}, {"callback_url": "https://93.184.216.34/other"},
    {"file_id": None},
], ids=lambda c: next(iter(c)))
def test_a_key_reused_with_any_field_changed_is_a_mismatch_not_a_replay(api, change):
    """Every field that changes what the task does or where it reports is in the fingerprint."""
    file_id = upload(api, files.wav()).json()["id"]
    other_file = upload(api, files.wav(2)).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt", "priority": "interactive",
            "params": {"language": "en"}, "deadline_s": 3600, "callback_url": "https://93.184.216.34/hook"}
    assert submit(api, body, key="walk-1").status_code == 202
    changed = {**body, **change}
    if "file_id" in change:
        changed["file_id"] = other_file
    answer = submit(api, changed, key="walk-1")
    assert answer.status_code == 422 and answer.json()["code"] == "idempotency_key_mismatch", answer.content
    assert Task.objects.count() == 1


def test_same_key_different_request_is_422_mismatch(api):
    file_id = upload(api, files.wav()).json()["id"]
    submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}, key="order-2")
    answer = submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "srt"}, key="order-2")
    assert answer.status_code == 422 and answer.json()["code"] == "idempotency_key_mismatch"
    assert Task.objects.count() == 1


def hold_the_lane(tenant, lane: str = "interactive"):
    """In a thread: the lane's admission is busy (PostgreSQL: its gate's lock; SQLite: a write
    transaction) until `release` is set. Returns (thread, release) once it is held."""
    import threading

    from django.db import connection, transaction

    from tasks import locks

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                locks.hold(("lane-gate", lane))
                Tenant.objects.filter(pk=tenant.pk).update(name=tenant.name)
                held.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    return holder, release


@pytest.mark.django_db(transaction=True)
def test_same_key_while_the_first_is_still_being_accepted(tenant, token):
    """Two requests with one key at once. PostgreSQL: while the first is being accepted, the
    second is refused with 409 idempotency_key_in_use (Retry-After 1) instead of waiting, and a
    retry afterwards replays the first. SQLite: the first has committed before the second can
    look, and the second replays it. Either way: one task."""
    import threading
    import time

    from django.db import connection
    from django.test import Client


    def client() -> Client:
        return Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    file_id = upload(client(), files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt", "priority": "interactive"}

    answers: dict[str, object] = {}

    def send(name: str) -> None:
        try:
            answers[name] = submit(client(), body, key="order-3")
        finally:
            connection.close()

    holder, release = hold_the_lane(tenant)
    first = threading.Thread(target=send, args=("first",))
    first.start()
    if connection.vendor == "postgresql":
        # The first holds its key and waits for the lane: it is being accepted.
        with connection.cursor() as cursor:
            for _ in range(200):
                cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                if cursor.fetchone()[0]:
                    break
                time.sleep(0.02)
        second = submit(client(), body, key="order-3")
        assert second.status_code == 409 and second.json()["code"] == "idempotency_key_in_use"
        assert second["Retry-After"] == "1"
        release.set()
        first.join(30)
        assert answers["first"].status_code == 202 and not answers["first"].has_header("Idempotent-Replayed")
        replay = submit(client(), body, key="order-3")
        assert replay.status_code == 202 and replay["Idempotent-Replayed"] == "true"
        assert replay.json()["id"] == answers["first"].json()["id"]
    else:
        second = threading.Thread(target=send, args=("second",))
        second.start()
        release.set()
        first.join(30)
        second.join(30)
        ids = {answers[name].json()["id"] for name in ("first", "second")}
        assert [answers[name].status_code for name in ("first", "second")] == [202, 202] and len(ids) == 1
        assert sum(answers[name].has_header("Idempotent-Replayed") for name in ("first", "second")) == 1
    holder.join(10)
    assert Task.objects.get().idempotency_key == "order-3"


@pytest.mark.django_db(transaction=True)
def test_a_key_taken_between_a_batchs_read_and_its_write_is_replayed_not_written_twice(tenant, token, caplog):
    """Another request (another web process) takes a key just after a batch with that key read
    its lanes and the key's holder. SQLite decides a batch before its write transaction and checks
    the decision under the one writer's lock: it finds the new holder and decides again, replaying
    it (never a second task, never a unique-key error). PostgreSQL holds the key's lock from before
    that read: the other request is refused with 409 while the batch's item is accepted."""
    import threading

    from django.db import connection
    from django.test import Client

    from tasks import costs

    def client() -> Client:
        return Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    file_id = upload(client(), files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt", "priority": "interactive"}
    items = [{**body, "idempotency_key": key} for key in ("before", "between", "after")]
    other: dict[str, object] = {}

    def send() -> None:
        try:
            other["answer"] = submit(client(), body, key="between")
        finally:
            connection.close()

    def spy(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if costs.kind(sql) == "SELECT tasks_lane" and '"max_queued"' in sql and "answer" not in other:
            racer = threading.Thread(target=send)
            racer.start()
            racer.join(30)
        return result

    with connection.execute_wrapper(spy):
        answer = client().post("/api/v1/tasks/batch", data=json.dumps({"items": items}), content_type="application/json")
    assert answer.status_code == 200, answer.content
    data = answer.json()["data"]
    assert [item["status"] for item in data] == [202, 202, 202], data
    if connection.vendor == "postgresql":
        assert other["answer"].status_code == 409 and other["answer"].json()["code"] == "idempotency_key_in_use"
        assert [item["replayed"] for item in data] == [False, False, False]
    else:
        assert other["answer"].status_code == 202 and not other["answer"].has_header("Idempotent-Replayed")
        assert [item["replayed"] for item in data] == [False, True, False]
        assert data[1]["id"] == other["answer"].json()["id"]
    assert Task.objects.filter(idempotency_key="between").count() == 1
    assert Task.objects.count() == 3
    again = logged(caplog, "intake_decided_again")
    expected = [] if connection.vendor == "postgresql" else [("key_taken", 3)]
    assert [(e["reason"], e["count"]) for e in again] == expected, again


@pytest.mark.django_db(transaction=True)
def test_submissions_arriving_while_one_is_written_share_the_next_transaction_each_answered_on_its_own(tenant, token):
    """A group commit: submissions of one tenant that arrive while another of its submissions is
    being written wait together and are written in one transaction (one acceptance stamp), each
    decided on its own: an unknown file is that submission's 404 and no other's."""
    import threading
    import time

    from django.db import connection
    from django.test import Client

    from tasks.services import intake

    def client() -> Client:
        return Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    file_id = upload(client(), files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt", "priority": "interactive"}

    answers: dict[str, object] = {}

    def send(name: str, body: dict, key: str) -> threading.Thread:
        def run() -> None:
            try:
                answers[name] = submit(client(), body, key=key)
            finally:
                connection.close()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    holder, release = hold_the_lane(tenant)
    threads = [send("first", body, "k-first")]
    time.sleep(0.3)  # the first is being written: it waits for the lane
    group = (tenant.pk, f"api tenant {tenant.name}", "interactive")
    assert intake._submissions.waiting(group) == 0
    grouped = {"b": body, "c": {**body, "file_id": "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d"}, "d": body}
    for index, (name, sent) in enumerate(grouped.items()):
        threads.append(send(name, sent, f"k-{name}"))
        deadline = time.monotonic() + 10
        while intake._submissions.waiting(group) < index + 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    runs = (intake._submissions.groups_run, intake._submissions.items_run)
    release.set()
    for thread in [*threads, holder]:
        thread.join(30)
    # Two transactions: the first's, then b, c and d's.
    assert (intake._submissions.groups_run - runs[0], intake._submissions.items_run - runs[1]) == (2, 4)
    assert [answers[name].status_code for name in ("first", "b", "c", "d")] == [202, 202, 404, 202]
    assert answers["c"].json()["code"] == "file_not_found"
    tasks = {task.idempotency_key: task for task in Task.objects.all()}
    assert sorted(tasks) == ["k-b", "k-d", "k-first"]
    assert {answers[name].json()["id"] for name in ("b", "d")} == {str(tasks["k-b"].pk), str(tasks["k-d"].pk)}
    if connection.vendor == "postgresql":  # the transaction that wrote each row
        with connection.cursor() as cursor:
            cursor.execute("SELECT idempotency_key, xmin::text FROM tasks_task")
            writer = dict(cursor.fetchall())
        assert writer["k-b"] == writer["k-d"] != writer["k-first"]
    assert TaskEvent.objects.filter(task__in=list(tasks.values())).count() == 3


def test_a_task_the_previous_release_accepted_keeps_its_fingerprint_in_its_record(api, tenant):
    """While migrations 0025-0026 run, processes of the release before still accept tasks: with
    the key on the task but its request's fingerprint only in the key's record. Its key replays
    the same request and refuses another, before 0026 copies the fingerprint onto the task and
    after."""
    from importlib import import_module
    from types import SimpleNamespace

    from django.apps import apps
    from django.db import connection

    from tasks.services.intake import validate_submission

    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt"}
    first = submit(api, body, key="order-5").json()["id"]
    # What the previous release wrote: the task without the fingerprint, the record with it.
    Task.objects.filter(pk=first).update(idempotency_fingerprint=None)
    IdempotencyRecord.objects.create(tenant=tenant, key="order-5", fingerprint=validate_submission(body).fingerprint(),
                                     task_id=first)
    copy = import_module("tasks.migrations.0026_keys_on_the_task").copy_fingerprints
    for copied in (False, True):
        if copied:
            assert copy(apps, SimpleNamespace(connection=connection)) == 1
            assert Task.objects.get(pk=first).idempotency_fingerprint == validate_submission(body).fingerprint()
        assert submit(api, body, key="order-5").json()["id"] == first
        other = submit(api, {**body, "target_format": "srt"}, key="order-5")
        assert other.status_code == 422 and other.json()["code"] == "idempotency_key_mismatch"
    assert Task.objects.count() == 1


@pytest.mark.parametrize("same_request", [True, False], ids=["same", "different"])
def test_a_key_past_its_time_makes_a_new_task(api, same_request):
    """Keys are kept at least 24 hours (48 here): used again later, before the prune has come
    by, a key makes a new task (neither a replay nor a 500 on the old task's unique key), and
    the old task forgets it."""
    from datetime import timedelta

    from django.utils import timezone

    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt"}
    later = body if same_request else {**body, "target_format": "srt"}
    first = submit(api, body, key="order-7").json()["id"]
    Task.objects.filter(pk=first).update(created_at=timezone.now() - timedelta(hours=49))
    again = submit(api, later, key="order-7")
    assert again.status_code == 202, again.content
    assert again.json()["id"] != first and not again.has_header("Idempotent-Replayed")
    assert Task.objects.filter(pk=first).values_list("idempotency_key", "idempotency_fingerprint").get() == (None, None)
    replay = submit(api, later, key="order-7")
    assert replay.json()["id"] == again.json()["id"] and replay["Idempotent-Replayed"] == "true"


def test_the_prune_forgets_the_keys_past_their_time_and_keeps_the_others(api, tenant):
    from datetime import timedelta

    from django.utils import timezone

    from tasks.services.housekeeping import prune_idempotency_keys

    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt"}
    old, older, young = (submit(api, body, key=key).json()["id"] for key in ("old", "older", "young"))
    Task.objects.filter(pk__in=[old, older]).update(created_at=timezone.now() - timedelta(hours=49))
    # A record the release before 0025 wrote, as old: deleted with them.
    IdempotencyRecord.objects.create(tenant=tenant, key="older", fingerprint="f", task_id=older)
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(hours=49))
    assert prune_idempotency_keys(chunk=1) == 2
    assert {str(pk): key for pk, key in Task.objects.values_list("pk", "idempotency_key")} == {
        old: None, older: None, young: "young"}
    assert not IdempotencyRecord.objects.exists() and prune_idempotency_keys() == 0
    assert submit(api, body, key="young")["Idempotent-Replayed"] == "true"


def test_keys_are_per_tenant(api, client):
    other = tenant_ensure(name="globex")
    other_token = token_issue(tenant=other).token
    file_id = upload(api, files.wav()).json()["id"]
    submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}, key="shared-key")
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {other_token}"
    their_file = upload(client, files.wav()).json()["id"]
    answer = submit(client, {"file_id": their_file, "kind": "transcription", "target_format": "txt"}, key="shared-key")
    assert answer.status_code == 202 and Task.objects.count() == 2


def test_another_tenants_token_gets_404_on_every_file_and_task_endpoint(api, client):
    file_id = upload(api, files.wav()).json()["id"]
    task_id = submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}).json()["id"]
    other_token = token_issue(tenant=tenant_ensure(name="initech")).token
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {other_token}"
    for method, path in [
        ("get", f"/api/v1/files/{file_id}"),
        ("get", f"/api/v1/tasks/{task_id}"),
        ("get", f"/api/v1/tasks/{task_id}/events"),
        ("post", f"/api/v1/tasks/{task_id}/cancel"),
        ("get", f"/api/v1/tasks/{task_id}/result"),
        ("post", f"/api/v1/tasks/{task_id}/result-link"),
    ]:
        answer = getattr(client, method)(path)
        assert answer.status_code == 404, path
    answer = submit(client, {"file_id": file_id, "kind": "transcription", "target_format": "txt"})
    assert answer.status_code == 404 and answer.json()["code"] == "file_not_found"
    assert client.get("/api/v1/tasks").json()["data"] == []
    assert Task.objects.get(pk=task_id).state == "ACCEPTED"


def test_cancel_before_start_is_immediate_and_a_second_cancel_is_409(api):
    file_id = upload(api, files.wav()).json()["id"]
    task_id = submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}).json()["id"]
    answer = api.post(f"/api/v1/tasks/{task_id}/cancel")
    assert answer.status_code == 202 and answer.json()["state"] == "CANCELLED"
    again = api.post(f"/api/v1/tasks/{task_id}/cancel")
    assert again.status_code == 409 and again.json()["code"] == "already_finished"


def test_result_before_success_is_409_not_ready(api):
    file_id = upload(api, files.wav()).json()["id"]
    task_id = submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}).json()["id"]
    answer = api.get(f"/api/v1/tasks/{task_id}/result")
    assert answer.status_code == 409 and answer.json()["code"] == "not_ready"


def test_list_paginates_with_a_cursor_and_filters_by_state(api):
    file_id = upload(api, files.wav()).json()["id"]
    ids = [submit(api, {"file_id": file_id, "kind": "transcription", "target_format": "txt"}).json()["id"] for _ in range(5)]
    page = api.get("/api/v1/tasks?limit=2").json()
    seen = [t["id"] for t in page["data"]]
    while page["next_cursor"]:
        page = api.get(f"/api/v1/tasks?limit=2&cursor={page['next_cursor']}").json()
        seen += [t["id"] for t in page["data"]]
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    assert api.get("/api/v1/tasks?state=SUCCEEDED").json()["data"] == []
    assert api.get("/api/v1/tasks?state=DONE").status_code == 400
    assert api.get("/api/v1/tasks?limit=0").status_code == 400
    assert api.get("/api/v1/tasks?cursor=garbage!").status_code == 400


def test_openapi_describes_every_endpoint(client):
    document = client.get("/api/v1/openapi.json").json()
    assert document["openapi"].startswith("3.")
    for path in ["/api/v1/files", "/api/v1/files/{file_id}", "/api/v1/tasks", "/api/v1/tasks/{task_id}",
                 "/api/v1/tasks/{task_id}/events", "/api/v1/tasks/{task_id}/cancel", "/api/v1/tasks/{task_id}/result",
                 "/api/v1/tasks/{task_id}/result-link", "/api/v1/results/{token}", "/api/v1/vendor-callbacks/{channel_name}"]:
        assert path in document["paths"], path
    for operations in document["paths"].values():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    assert list(response["content"]) == ["application/problem+json"]


def test_the_document_is_generated_from_the_declarations_that_validate(client):
    from tasks.filetypes import TARGET_FORMATS
    from tasks.states import State

    schemas = client.get("/api/v1/openapi.json").json()["components"]["schemas"]
    body = client.get("/api/v1/openapi.json").json()["paths"]["/api/v1/tasks"]["post"]["requestBody"]
    variants = body["content"]["application/json"]["schema"]
    assert variants["discriminator"]["propertyName"] == "kind"
    for kind, targets in TARGET_FORMATS.items():
        variant = schemas[variants["discriminator"]["mapping"][kind].rsplit("/", 1)[1]]
        assert variant["properties"]["kind"]["const"] == kind
        assert variant["properties"]["target_format"]["enum"] == list(targets)  # the pairing, per kind
        assert variant["additionalProperties"] is False
    assert schemas["TaskOut"]["properties"]["state"]["enum"] == list(State.values)


@pytest.mark.django_db(transaction=True)
def test_intake_answers_202_while_the_redis_broker_is_unreachable_and_the_dispatcher_sends_the_trigger_later(
        api, settings, monkeypatch):
    """A web host cut from Redis: the task is committed before the trigger is sent, so a broker
    that cannot be reached costs the trigger only — never a 500 for an accepted task."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks import queueing
    from tasks.services.dispatch import send_due_steps

    dead = "redis://127.0.0.1:1/0?socket_connect_timeout=1&socket_timeout=1"  # nothing listens on port 1
    broker = {k: v for k, v in settings.Q_CLUSTER.items() if k != "orm"}
    settings.Q_CLUSTER = {**broker, "redis": dead}
    monkeypatch.setattr("django_q.conf.Conf.REDIS", dead)
    monkeypatch.setattr("django_q.conf.Conf.ORM", None)
    monkeypatch.setattr("django_q.conf.Conf.BROKER_CLASS", None)
    monkeypatch.setattr(queueing, "_brokers", {})
    monkeypatch.setattr(queueing, "_unreachable_until", {})  # what this test learns stays in it
    assert type(queueing._broker("sluice-probe")).__name__ == "Redis"
    stored = upload(api, files.wav())
    answer = submit(api, {"file_id": stored.json()["id"], "kind": "transcription", "target_format": "txt"})
    assert answer.status_code == 202, answer.content
    task = Task.objects.get(pk=answer.json()["id"])
    # Marked unsent: a dispatcher that reaches the broker sends it on its next pass.
    assert task.state == "ACCEPTED" and task.enqueued_at is None
    # This one cannot either: its send fails the same way, nothing raises, the task stays due.
    assert send_due_steps(timezone.now() + timedelta(seconds=1)) == 1
    assert Task.objects.get(pk=task.pk).state == "ACCEPTED"


def test_a_database_that_cannot_be_reached_is_a_503_problem_and_nothing_is_accepted(api, monkeypatch):
    from django.db import OperationalError

    from tasks.services import intake

    stored = upload(api, files.wav())

    def unreachable(**kwargs):
        raise OperationalError("connection to server at 10.0.0.5, port 5432 failed: timeout expired")

    monkeypatch.setattr(intake, "_admit_one", unreachable)
    answer = submit(api, {"file_id": stored.json()["id"], "kind": "transcription", "target_format": "txt"}, key="k-db")
    assert answer.status_code == 503 and answer.json()["code"] == "database_unavailable", answer.content
    assert answer["Retry-After"] and "10.0.0.5" not in answer.content.decode()
    assert not Task.objects.exists()
    monkeypatch.undo()  # the database is back: the same submission, same key, is accepted
    again = submit(api, {"file_id": stored.json()["id"], "kind": "transcription", "target_format": "txt"}, key="k-db")
    assert again.status_code == 202, again.content
    assert Task.objects.count() == 1


def test_a_file_id_in_another_spelling_of_the_same_uuid_is_the_same_file(api):
    file_id = upload(api, files.wav()).json()["id"]
    for spelling in (file_id.upper(), file_id.replace("-", "")):
        answer = submit(api, {"file_id": spelling, "kind": "transcription", "target_format": "txt"})
        assert answer.status_code == 202, (spelling, answer.content)
        assert str(Task.objects.get(pk=answer.json()["id"]).file_id) == file_id


def test_a_submission_takes_no_savepoint(transactional_db, api):
    """One write transaction a submission, and no savepoint in it: on PostgreSQL a decision taken
    on an unlocked read that the read under the lane's lock would not take is rolled back whole
    and taken again (rare), instead of a savepoint paid for by every submission."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt"}
    with CaptureQueriesContext(connection) as statements:
        answer = submit(api, body, key="no-savepoint")
    assert answer.status_code == 202
    assert not [q["sql"] for q in statements.captured_queries if q["sql"].startswith("SAVEPOINT")]


def test_on_postgresql_a_submissions_file_is_read_in_the_statement_that_tries_its_keys_lock(transactional_db, api):
    """PostgreSQL: in its write transaction a submission reads its file and tries its key's lock
    in one statement; a file not found reads no row, and the lock is tried on its own (the key is
    answered for all the same)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        pytest.skip("SQLite's one writer needs no key locks")
    file_id = upload(api, files.wav()).json()["id"]
    body = {"file_id": file_id, "kind": "transcription", "target_format": "txt"}
    for key, expected in (("file-and-key", 202), ("file-and-key", 202), ("no-such-file", 404)):
        with CaptureQueriesContext(connection) as statements:
            answer = submit(api, {**body, "file_id": str(uuid.uuid4())} if expected == 404 else body, key=key)
        assert answer.status_code == expected, answer.content
        tried = [q["sql"] for q in statements.captured_queries if "pg_try_advisory_xact_lock" in q["sql"]]
        files_read = [q["sql"] for q in statements.captured_queries if "tasks_fileversion" in q["sql"]]
        assert len(files_read) == 1, files_read
        assert len(tried) == (1 if expected == 202 else 2) and "tasks_fileversion" in tried[0], tried
        assert "SELECT 1" not in [q["sql"] for q in statements.captured_queries], "no lock to wait for: no statement"
    assert Task.objects.count() == 1
