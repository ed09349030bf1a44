"""Scheduling promises of seeds 001 and 003 with the shipped lane defaults (issue 15)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from tasks import timescale
from tasks.models import Lane, Task, Tenant, TenantQuota
from tasks.poc import files
from tasks.services.dispatch import admit_lane, promote_retries
from tasks.services.outcomes import task_move
from tasks.services.tenancy import tenant_ensure
from tests.support.flows import logged

pytestmark = pytest.mark.django_db(transaction=True)


def queued_task(tenant, lane: Lane, *, waited_s: float, deadline_s: float = 86400, index: int = 0) -> Task:
    """A task that entered the lane's queue `waited_s` nominal seconds ago (its own rows, as intake writes them)."""
    from tasks.models import FileVersion

    now = timezone.now()
    queued = now - timescale.delta(waited_s)
    file = FileVersion.objects.create(tenant=tenant, sha256=f"{index:064x}", size=1000, detected_type="audio/x-wav",
                                      storage_name=f"x/{index}", precheck_state="passed")
    deadline_at = queued + timescale.delta(deadline_s)
    queue_deadline_at = queued + timescale.delta(lane.queue_deadline_s)
    task = Task.objects.create(
        tenant=tenant, file=file, kind="transcription", target_format="txt", priority="batch", lane=lane,
        deadline_at=deadline_at, queue_deadline_at=queue_deadline_at,
        dispatch_deadline_at=min(deadline_at, queue_deadline_at), queued_at=queued,
    )
    # Into QUEUED through the one state writer, as the pre-check would.
    task_move(task.pk, source="ACCEPTED", target="QUEUED", generation=0, actor="test", reason="queued",
              fields=dict(queued_at=queued))
    Task.objects.filter(pk=task.pk).update(created_at=queued)
    return Task.objects.get(pk=task.pk)


def admissions(lane: Lane, *, until) -> list:
    """Admit, let each admitted task finish at once (its slot comes back), admit again..."""
    order = []
    for _ in range(100):
        sent = admit_lane(Lane.objects.get(pk=lane.pk), timezone.now())
        if not sent:
            break
        for task_id, generation, _ in sent:
            task = Task.objects.get(pk=task_id)
            order.append(task)
            task_move(task.pk, source="QUEUED", target="CANCELLED", generation=task.generation, actor="test",
                      reason="finished")
        if until(order):
            break
    return order


def test_fair_share_survives_aging_with_the_default_aging(transactional_db):
    """A floods 200 tasks; B submits 10 a minute later. With the batch lane's default aging (120 s),
    A's old tasks must not turn the lane into FIFO: B gets its share of the slots at once."""
    lane = Lane.objects.get(pk="batch")
    alpha, beta = tenant_ensure(name="alpha"), tenant_ensure(name="beta")
    for i in range(200):
        queued_task(alpha, lane, waited_s=150 + i * 0.01, index=i)
    for i in range(10):
        queued_task(beta, lane, waited_s=90 - i * 0.01, index=1000 + i)
    order = admissions(lane, until=lambda o: sum(t.tenant_id == beta.pk for t in o) == 10)
    starts = "".join("B" if t.tenant_id == beta.pk else "A" for t in order)
    assert starts[:20].count("B") == 10, f"start order {starts[:40]}: B waited behind A's flood"


def test_aging_still_lifts_a_tenant_that_fair_share_would_starve(transactional_db):
    lane = Lane.objects.get(pk="batch")
    big, tiny = tenant_ensure(name="big"), tenant_ensure(name="tiny")
    TenantQuota.objects.filter(tenant=tiny).update(lane_weights={"batch": 0.01})
    for i in range(60):
        queued_task(big, lane, waited_s=10, index=i)
    queued_task(tiny, lane, waited_s=lane.aging_s + 30, index=999)
    order = admissions(lane, until=lambda o: any(t.tenant_id == tiny.pk for t in o))
    position = next(i for i, t in enumerate(order) if t.tenant_id == tiny.pk)
    assert position < 21, f"the starved tenant started only at position {position}"


def test_dispatch_follows_the_earliest_deadline_and_a_retry_keeps_its_place(transactional_db):
    """In the batch lane (queue deadline 6 h) business deadlines below it decide the order."""
    lane = Lane.objects.get(pk="batch")
    tenant = tenant_ensure(name="acme")
    TenantQuota.objects.filter(tenant=tenant).update(max_running=1)
    deadlines = [14400, 600, 7200, 120, 3600, 900, 10800, 1800]
    tasks = [queued_task(tenant, lane, waited_s=10 - i, deadline_s=d, index=i) for i, d in enumerate(deadlines)]
    # The 600 s task was tried and came back from RETRY_WAIT: it keeps its deadline's place.
    retried = tasks[1]
    task_move(retried.pk, source="QUEUED", target="RETRY_WAIT", generation=retried.generation, actor="test",
              reason="parked", fields=dict(due_at=timezone.now() - timedelta(seconds=1)))
    assert promote_retries(timezone.now()) == 1
    order = admissions(lane, until=lambda o: len(o) == len(deadlines))
    started = [deadlines[tasks.index(next(t for t in tasks if t.pk == s.pk))] for s in order]
    assert started == sorted(deadlines), f"started by deadline {started}"


def test_a_task_near_its_deadline_goes_before_fair_share(transactional_db):
    lane = Lane.objects.get(pk="interactive")
    calm, hurried = tenant_ensure(name="calm"), tenant_ensure(name="hurried")
    busy = [queued_task(hurried, lane, waited_s=30, index=i) for i in range(4)]
    Task.objects.filter(pk__in=[t.pk for t in busy]).update(dispatched_at=timezone.now())
    for i in range(3):
        queued_task(calm, lane, waited_s=1, index=100 + i)
    # Fair share would pick calm (nothing running) before hurried (four running)...
    urgent = queued_task(hurried, lane, waited_s=lane.queue_deadline_s - 20, index=200)
    sent = admit_lane(lane, timezone.now())
    assert sent[0][0] == urgent.pk, "the task 20 s from its queue deadline waited behind fair share"
    assert {Task.objects.get(pk=t).tenant_id for t, _, _ in sent[1:]} == {calm.pk}


# --- admission closes early, in every policy ---------------------------------------------------------
def test_a_defer_lane_defers_new_work_at_its_early_close_threshold(transactional_db, api):
    Lane.objects.filter(pk="batch").update(max_queued=10)
    answers = []
    for i in range(12):
        body = {**_body(api, i), "priority": "batch"}
        answers.append(api.post("/api/v1/tasks", data=json.dumps(body), content_type="application/json"))
    assert [a.status_code for a in answers] == [202] * 12
    deferred = [a.json().get("waiting_reason") == "lane_full" for a in answers]
    assert deferred == [False] * 8 + [True] * 4, "the batch lane (defer, 80 %) must defer from the 9th task"


def test_a_reject_lane_answers_503_at_its_early_close_threshold(transactional_db, api):
    Lane.objects.filter(pk="interactive").update(max_queued=10, early_close_pct=80)
    statuses = [api.post("/api/v1/tasks", data=json.dumps(_body(api, i)), content_type="application/json")
                for i in range(10)]
    assert [a.status_code for a in statuses] == [202] * 8 + [503] * 2
    refused = statuses[-1]
    assert refused["Content-Type"] == "application/problem+json" and refused.json()["code"] == "backlog_full"
    assert "80%" in refused.json()["detail"] and int(refused["Retry-After"]) >= 1


def test_concurrent_submissions_fill_a_lane_exactly_to_its_threshold(transactional_db, api, token):
    """Sixteen submissions at once to a lane that closes at 8 waiting tasks: exactly 8 accepted
    (reject lane) and exactly 8 not deferred (defer lane). On PostgreSQL a submission decides on
    an unlocked read and checks that decision under its lane's lock: the check must catch every
    read that others' commits made stale."""
    import threading

    from django.db import connection
    from django.test import Client

    Lane.objects.filter(pk__in=["interactive", "batch"]).update(max_queued=10, early_close_pct=80)
    bodies = [_body(api, i) for i in range(32)]
    answers: dict[int, object] = {}
    start = threading.Barrier(16)

    def send(index: int, priority: str) -> None:
        try:
            client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            start.wait(10)
            answers[index] = client.post("/api/v1/tasks", data=json.dumps({**bodies[index], "priority": priority}),
                                         content_type="application/json", HTTP_IDEMPOTENCY_KEY=f"k-{index}")
        finally:
            connection.close()

    for priority, indexes in (("interactive", range(16)), ("batch", range(16, 32))):
        threads = [threading.Thread(target=send, args=(i, priority)) for i in indexes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    interactive = [answers[i].status_code for i in range(16)]
    assert sorted(interactive) == [202] * 8 + [503] * 8
    assert Task.objects.filter(lane="interactive").count() == 8
    batch = [answers[i] for i in range(16, 32)]
    assert [a.status_code for a in batch] == [202] * 16
    assert sum(a.json().get("waiting_reason") == "lane_full" for a in batch) == 8
    assert Task.objects.filter(lane="batch", deferred=False).count() == 8


def test_a_decision_made_stale_while_waiting_for_the_lanes_lock_is_taken_again_under_it(transactional_db, api, token):
    """A submission reads its lane with room and writes its task; before it gets the lane's lock,
    another transaction fills the lane to its threshold. The submission must be refused, and on
    PostgreSQL its second decision must be taken holding the lane's lock (the first is rolled back
    with its transaction, which lets every lock go: without taking it again, a third submission
    could decide on counts that miss this one)."""
    import time

    from django.db import connection


    Lane.objects.filter(pk="interactive").update(max_queued=10, early_close_pct=80)
    bodies = [_body(api, i) for i in range(9)]
    for index in range(6):
        assert api.post("/api/v1/tasks", data=json.dumps(bodies[index]), content_type="application/json").status_code == 202
    seen: dict[str, object] = {"lane_reads": 0, "locks_at_second_decision": None}

    def spy(execute, sql, params, many, context):
        # PostgreSQL reads the lane for the tentative decision, again under the lock to check it,
        # and a third time (after the rollback) for the decision taken again.
        if _reads_lane_load(sql):
            seen["lane_reads"] += 1
            if seen["lane_reads"] == 3:
                with context["connection"].connection.cursor() as raw:
                    raw.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                                "AND pid = pg_backend_pid()")
                    seen["locks_at_second_decision"] = raw.fetchone()[0]
        return execute(sql, params, many, context)

    holder, release = _hold_the_lane_then_submit(token, bodies[6:8])  # fills the lane to 8 once released
    late, answers = _submit_in_a_thread(token, "/api/v1/tasks", bodies[8], spy, HTTP_IDEMPOTENCY_KEY="late")
    if connection.vendor == "postgresql":
        _until_a_lock_is_awaited("the late submission")  # it has written its task and waits for the lane
    else:
        time.sleep(0.3)  # SQLite: it waits for the write lock before it reads anything
    release.set()
    holder.join(30)
    late.join(30)
    assert answers and answers[0].status_code == 503 and answers[0].json()["code"] == "backlog_full"
    assert Task.objects.filter(lane="interactive").count() == 8
    if connection.vendor == "postgresql":
        assert seen["lane_reads"] == 3, "the decision taken on the unlocked read was not taken again"
        # Its key's lock, let go with the rollback, tried again, and the lane's.
        assert seen["locks_at_second_decision"] == 2, "the second decision must hold its key's and its lane's locks"
    assert not Task.objects.filter(idempotency_key="late").exists()


def test_a_batch_decided_before_its_write_and_made_stale_meanwhile_is_decided_again(transactional_db, api, token,
                                                                                   caplog):
    """A batch reads its lane with room for all its items and decides (SQLite: before its write
    transaction; PostgreSQL: before the lane's lock); while it waits for the lock (SQLite: the one
    writer's), another transaction fills the lane to its threshold. The check under the lock
    finds the gate closed, and the batch is decided again under it: every item refused, nothing
    written (the lane read three times: the decision, its check, the decision taken again)."""
    import threading

    from django.db import connection


    Lane.objects.filter(pk="interactive").update(max_queued=20, early_close_pct=80)
    bodies = [_body(api, i) for i in range(19)]
    for index in range(12):
        assert api.post("/api/v1/tasks", data=json.dumps(bodies[index]), content_type="application/json").status_code == 202
    decided = threading.Event()
    lane_reads: list[str] = []

    def spy(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if _reads_lane_load(sql):
            lane_reads.append(sql)
            decided.set()
        return result

    holder, release = _hold_the_lane_then_submit(token, bodies[12:16])  # fills the lane to 16 once released
    late, answers = _submit_in_a_thread(token, "/api/v1/tasks/batch", {"items": bodies[16:]}, spy)
    if connection.vendor == "postgresql":
        _until_a_lock_is_awaited("the late batch")
    else:
        assert decided.wait(10)  # SQLite: it has read its lane (and goes on to wait for the write lock)
    release.set()
    holder.join(30)
    late.join(30)
    assert answers and answers[0].status_code == 200, answers and answers[0].content
    assert [(r["status"], r["code"]) for r in answers[0].json()["data"]] == [(503, "backlog_full")] * 3, answers[0].json()
    assert Task.objects.filter(lane="interactive").count() == 16
    assert len(lane_reads) == 3, lane_reads
    # Said to the operator: a decision taken ahead thrown away, and why.
    again = logged(caplog, "intake_decided_again")
    assert [(e["reason"], e["count"]) for e in again] == [("gate_closed", 3)], again


def _hold_the_lane_then_submit(token: str, bodies: list[dict]):
    """In a thread: hold the interactive lane's admission (PostgreSQL: its gate's lock; SQLite:
    a write transaction) until `release` is set, then submit `bodies` in that transaction (each
    accepted). Returns (thread, release) once it is held."""
    import threading

    from django.db import connection, transaction
    from django.test import Client

    from tasks import locks

    held, release = threading.Event(), threading.Event()

    def hold_and_fill() -> None:
        try:
            client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            with transaction.atomic():
                locks.hold(("lane-gate", "interactive"))
                Tenant.objects.filter(name="acme").update(name="acme")
                held.set()
                release.wait(30)
                for body in bodies:
                    answer = client.post("/api/v1/tasks", data=json.dumps(body), content_type="application/json")
                    assert answer.status_code == 202
        finally:
            connection.close()

    holder = threading.Thread(target=hold_and_fill)
    holder.start()
    assert held.wait(10)
    return holder, release


def _submit_in_a_thread(token: str, path: str, payload: dict, spy, **headers):
    """POST `payload` to `path` from a thread whose connection's statements pass through `spy`;
    returns (the started thread, the list its answer is appended to)."""
    import threading

    from django.db import connection
    from django.test import Client

    answers: list = []

    def submit() -> None:
        try:
            client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            with connection.execute_wrapper(spy):
                answers.append(client.post(path, data=json.dumps(payload), content_type="application/json", **headers))
        finally:
            connection.close()

    late = threading.Thread(target=submit)
    late.start()
    return late, answers


def _reads_lane_load(sql: str) -> bool:
    """A read of a lane with its load, which a decision takes (not the lane's execution timeout,
    which a message's timeout reads every few seconds)."""
    from tasks import costs

    return costs.kind(sql) == "SELECT tasks_lane" and '"max_queued"' in sql


def test_a_batch_that_waited_for_its_lane_past_the_oldest_wait_limit_is_not_closed_out_by_its_own_tasks(
        transactional_db, api, token):
    """PostgreSQL decides a submission on an unlocked read, writes its rows, then checks the
    decision against a read under the lane's lock. A batch to an empty lane that waits for that
    lock longer than the lane's oldest-wait limit reads its own first task as the lane's oldest
    waiting one: it counts as arriving at the decision, so its second task does not find the gate
    closing, and the decision stands without a rollback and a second decision (the lane read twice:
    for the tentative decision and under the lock to check it; a third read is the decision taken
    again after its transaction was rolled back)."""
    import threading
    import time

    from django.db import connection, transaction
    from django.test import Client

    from tasks import locks

    if connection.vendor != "postgresql":
        pytest.skip("the decision on an unlocked read is PostgreSQL's (SQLite's one writer serialises intake)")
    lane = Lane.objects.get(pk="interactive")
    limit_s = 10.0  # nominal: half a second at the tests' time scale
    Lane.objects.filter(pk=lane.pk).update(oldest_wait_limit_s=limit_s)
    items = [{**_body(api, i), "idempotency_key": f"own-{i}"} for i in range(2)]
    held, release = threading.Event(), threading.Event()
    lane_reads: list[str] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                locks.hold(("lane-gate", "interactive"))
                held.set()
                release.wait(30)
        finally:
            connection.close()

    def spy(execute, sql, params, many, context):
        if _reads_lane_load(sql):
            lane_reads.append(sql)
        return execute(sql, params, many, context)

    answers: list = []

    def submit() -> None:
        try:
            client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            with connection.execute_wrapper(spy):
                answers.append(client.post("/api/v1/tasks/batch", data=json.dumps({"items": items}),
                                           content_type="application/json"))
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    late = threading.Thread(target=submit)
    late.start()
    _until_a_lock_is_awaited("the batch")  # it has written its tasks and waits for the lane
    time.sleep(timescale.seconds(limit_s) * 2)
    release.set()
    holder.join(30)
    late.join(30)
    assert answers and answers[0].status_code == 200, answers and answers[0].content
    assert [r["status"] for r in answers[0].json()["data"]] == [202, 202], answers[0].json()
    assert Task.objects.filter(lane="interactive").count() == 2
    assert len(lane_reads) == 2, "the batch's own task was read as a lane's task waiting past its limit"


def test_admission_closes_while_the_oldest_queued_task_has_waited_too_long(transactional_db, api):
    lane = Lane.objects.get(pk="interactive")
    # Another tenant's task has waited past the lane's default limit (half its queue deadline).
    queued_task(tenant_ensure(name="other"), lane, waited_s=lane.oldest_wait_limit_s + 10, index=5)
    answer = api.post("/api/v1/tasks", data=json.dumps(_body(api, 1)), content_type="application/json")
    assert answer.status_code == 503 and "oldest queued task has waited" in answer.json()["detail"]


def test_the_active_worker_gate_closes_a_busy_lane_with_a_backlog(transactional_db, api):
    lane = Lane.objects.get(pk="interactive")
    Lane.objects.filter(pk=lane.pk).update(max_running=2, busy_close_pct=100)
    other = tenant_ensure(name="other")
    running = [queued_task(other, lane, waited_s=5, index=i) for i in range(2)]
    Task.objects.filter(pk__in=[t.pk for t in running]).update(dispatched_at=timezone.now())
    queued_task(other, lane, waited_s=1, index=9)
    answer = api.post("/api/v1/tasks", data=json.dumps(_body(api, 2)), content_type="application/json")
    assert answer.status_code == 503 and "slots are busy" in answer.json()["detail"]


def _until_a_lock_is_awaited(who: str) -> None:
    """Wait (5 s at most) until some PostgreSQL session waits for an advisory lock."""
    import time

    from django.db import connection

    with connection.cursor() as cursor:
        for _ in range(250):
            cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError(f"{who} never waited for the lane's lock")


def _body(api, index: int) -> dict:
    stored = api.post("/api/v1/files", data=files.wav(1), content_type="application/octet-stream",
                      HTTP_X_FILENAME="a.wav")
    assert stored.status_code == 201, stored.content
    return {"file_id": stored.json()["id"], "kind": "transcription", "target_format": "txt", "priority": "interactive"}



def test_a_finished_task_says_where_its_time_went_stage_by_stage(inline_queue, api):
    from tests.conftest import run_until
    from tests.support.flows import submit_file

    # Processing long enough (60 nominal s) that a poll sees the job processing whatever the
    # polls' cadence on a loaded machine (a CI run on PostgreSQL saw it only once completed at 20 s).
    inline_queue.control.channel("primary", processing_ms=60_000, queue_ms=1000)
    task = run_until(submit_file(api), timeout=60)
    stages = api.get(f"/api/v1/tasks/{task.pk}").json()["stages"]
    assert list(stages) == ["queued", "admitted", "uploading", "vendor_queued", "vendor_processing", "fetching", "notifying"]
    for stage in ("queued", "uploading", "vendor_queued", "vendor_processing", "fetching"):
        assert stages[stage] is not None and stages[stage] >= 0, (stage, stages)
    # The vendor processed for 60 nominal seconds: that is where most of the time went.
    assert stages["vendor_processing"] >= 60 * timescale.scale() * 0.5 > stages["uploading"]
    assert stages["notifying"] is None  # no callback URL


# --- timeouts reach the calls -----------------------------------------------------------------------------
def test_a_dribbled_result_download_is_cut_at_its_wall_clock_deadline_and_downloaded_again(inline_queue, api):
    """httpx's read timeout is per read: without a wall-clock deadline a result dribbled for 60 s
    would hold the worker although the channel's result timeout is 30 s."""
    from tasks.models import VendorCall, VendorChannel
    from tests.conftest import run_until
    from tests.support.flows import submit_file

    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    inline_queue.control.add_rule({"endpoint": "GET /v1/jobs/*/result", "type": "dribble",
                                   "params": {"chunks": 30, "total_ms": 60_000}, "times": 1})
    task = run_until(submit_file(api), timeout=60)
    assert task.state == "SUCCEEDED"
    cut = VendorCall.objects.get(task=task, operation="get_result", error_class="DownloadDeadlineExceeded")
    limit_ms = VendorChannel.objects.get(pk="primary").result_timeout_s * 1000 * timescale.scale()
    assert cut.duration_ms <= limit_ms * 1.5, f"the download ran {cut.duration_ms} ms against a {limit_ms:.0f} ms deadline"
    assert VendorCall.objects.filter(task=task, operation="get_result", outcome="ok").count() == 1


def test_no_vendor_call_outlives_the_attempt_it_serves(transactional_db, settings):
    from tasks.models import VendorChannel
    from tasks.vendors.http import MIN_CALL_S, VendorHttp, problem_details

    settings.TIME_SCALE = 1.0
    channel = VendorChannel.objects.get(pk="primary")
    soon = timezone.now() + timedelta(seconds=2)
    http = VendorHttp(channel, auth_headers={}, error_details=problem_details, deadline=soon)
    timeout = http.timeout(channel.status_timeout_s)
    assert timeout.read <= 2.0 and timeout.connect <= 2.0, timeout
    late = VendorHttp(channel, auth_headers={}, error_details=problem_details, deadline=timezone.now() - timedelta(seconds=5))
    assert late.timeout(channel.status_timeout_s).read == MIN_CALL_S
    free = VendorHttp(channel, auth_headers={}, error_details=problem_details)
    assert free.timeout(channel.status_timeout_s).read == channel.status_timeout_s


def test_each_step_is_sent_with_its_lanes_execution_timeout_plus_the_grace(transactional_db, settings):
    from tasks.queueing import _lane_timeouts, step_timeout_s

    _lane_timeouts.clear()
    lane = Lane.objects.get(pk="interactive")
    grace = max(settings.STEP_GRACE_S * settings.TIME_SCALE, settings.STEP_GRACE_FLOOR_S)
    assert step_timeout_s("interactive") == min(int(-(-(lane.execution_timeout_s * settings.TIME_SCALE + grace) // 1)),
                                                settings.LANE_STEP_TIMEOUT_S["interactive"])
    assert step_timeout_s("interactive") <= settings.Q_CLUSTER["ALT_CLUSTERS"]["interactive"]["retry"] - 30


def test_a_pass_that_waited_for_the_admission_lock_stamps_the_moment_it_decided(transactional_db):
    """Two passes race: one holds the admission lock while the other, begun earlier, waits for it.
    The waiting pass admits only after the lock is free, so its tasks' dispatched_at must say so:
    stamped with the time the pass began, they would read as admitted before tasks the other pass
    had already started (an earliest-deadline-first order that looks inverted, and queue waits
    that look shorter than they were)."""
    import threading

    from django.db import connection

    from tasks.services.dispatch import dispatch_lock

    lane = Lane.objects.get(pk="batch")
    tenant = tenant_ensure(name="acme")
    task = queued_task(tenant, lane, waited_s=5, index=1)
    held, release = threading.Event(), threading.Event()
    released_at = []

    def hold_the_lock():
        try:
            with dispatch_lock():
                held.set()
                release.wait(10)
                released_at.append(timezone.now())
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert held.wait(10)
    began = timezone.now()
    threading.Timer(0.5, release.set).start()
    sent = admit_lane(lane, began)
    holder.join()
    assert [t for t, _, _ in sent] == [task.pk]
    dispatched_at = Task.objects.get(pk=task.pk).dispatched_at
    assert dispatched_at >= released_at[0], (
        f"admitted after the lock was released at {released_at[0]:%H:%M:%S.%f} but stamped {dispatched_at:%H:%M:%S.%f}")
