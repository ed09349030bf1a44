"""tasks/rows.py: the INSERTs and reads built without the ORM's query compiler write and read
exactly what the ORM would (both databases: the suite runs again on PostgreSQL)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import Value
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks.models import FileVersion, Lane, Task, TaskEvent, VendorCall, VendorChannel
from tasks.rows import insert_rows, insert_together, select

pytestmark = pytest.mark.django_db(transaction=True)


CHECKED_AT = timezone.now() - timedelta(minutes=3)


def _file(tenant, **extra) -> FileVersion:
    return FileVersion(tenant=tenant, sha256="ab" * 32, size=12345, detected_type="audio/x-wav", extension="wav",
                       label="a.wav", storage_name="x", precheck_findings={"audio_minutes": 1.5, "nested": {"k": [1, 2]}},
                       precheck_state=FileVersion.Precheck.PASSED, prechecked_at=CHECKED_AT,
                       **extra)


def _task(tenant, **extra) -> Task:
    """A stored task of a stored file (ACCEPTED, generation 0)."""
    file = _file(tenant)
    file.save()
    return Task.objects.create(tenant=tenant, file=file, kind="transcription", target_format="txt",
                               deadline_at=timezone.now() + timedelta(hours=1), **extra)


def _values(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields}


def test_rows_inserted_read_back_through_the_orm_as_bulk_create_writes_them(tenant):
    ours, theirs = _file(tenant), _file(tenant)
    insert_rows([ours])
    FileVersion.objects.bulk_create([theirs])
    read_ours, read_theirs = FileVersion.objects.get(pk=ours.pk), FileVersion.objects.get(pk=theirs.pk)
    skip = {"id", "created_at"}
    assert {k: v for k, v in _values(read_ours).items() if k not in skip} == \
        {k: v for k, v in _values(read_theirs).items() if k not in skip}
    assert read_ours.created_at == ours.created_at  # auto_now_add set on the instance, as save() sets it
    lane = Lane.objects.get(pk="batch")
    task = Task(tenant=tenant, file=ours, kind="transcription", target_format="txt", params={"language": "de"},
                lane=lane, deadline_at=timezone.now() + timedelta(hours=1), due_at=timezone.now())
    event = TaskEvent(task=task, from_state="", to_state="ACCEPTED", generation=0, actor="t", reason="r", data={"a": 1})
    with transaction.atomic():  # inside a caller's transaction: its statements, nothing of their own
        with CaptureQueriesContext(connection) as statements:
            insert_rows([task])
            insert_rows([event])
    assert [q["sql"].split()[0] for q in statements.captured_queries] == ["INSERT", "INSERT"]
    assert TaskEvent.objects.get(pk=event.pk).task_id == task.pk  # the key the database assigned, read back
    stored = Task.objects.get(pk=task.pk)
    assert (stored.params, stored.lane_id, stored.file_id, stored.state, stored.generation) == \
        ({"language": "de"}, "batch", ours.pk, "ACCEPTED", 0)
    assert TaskEvent.objects.get(task=task).data == {"a": 1}


def test_tasks_and_their_entries_are_written_together_in_one_statement_on_postgresql(tenant):
    """insert_together: two models' rows as insert_rows writes each (one row or several), in one
    statement on PostgreSQL, two elsewhere; the entries' database-assigned keys read back; a
    failing second part leaves neither."""
    files = [_file(tenant) for _ in range(2)]
    insert_rows(files)
    for count in (1, 2):
        tasks = [Task(tenant=tenant, file=files[n], kind="transcription", target_format="txt", params={"n": n},
                      lane_id="batch", deadline_at=timezone.now() + timedelta(hours=1)) for n in range(count)]
        events = [TaskEvent(task=task, from_state="", to_state="ACCEPTED", generation=0, actor="t", reason=f"r{n}",
                            data={"n": n}) for n, task in enumerate(tasks)]
        with CaptureQueriesContext(connection) as statements:
            insert_together(tasks, events)
        assert len(statements.captured_queries) == (1 if connection.vendor == "postgresql" else 2)
        for n, (task, event) in enumerate(zip(tasks, events, strict=True)):
            stored = TaskEvent.objects.select_related("task").get(pk=event.pk)
            assert (stored.task_id, stored.reason, stored.data, stored.task.params) == (task.pk, f"r{n}", {"n": n}, {"n": n})
    task = Task(tenant=tenant, file=files[0], kind="transcription", target_format="txt",
                deadline_at=timezone.now() + timedelta(hours=1))
    broken = TaskEvent(task=task, from_state="", to_state="ACCEPTED", generation=None, actor="t", reason="r")
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_together([task], [broken])
    assert not Task.objects.filter(pk=task.pk).exists()


def test_a_returned_primary_key_rows_beyond_one_statement_and_expressions_left_to_the_orm():
    channel = VendorChannel.objects.first() or VendorChannel.objects.create(name="rows", base_url="http://127.0.0.1:1")
    pk = insert_rows([VendorCall(channel=channel, operation="poll", outcome="ok", duration_ms=7)], return_pk=True)
    assert VendorCall.objects.get(pk=pk).duration_ms == 7
    many = [VendorCall(channel=channel, operation="poll", outcome="ok", duration_ms=10 + i) for i in range(2000)]
    insert_rows(many)
    assert VendorCall.objects.filter(channel=channel).count() == 2001
    assert len({call.pk for call in many} - {None}) == 2000
    insert_rows([VendorCall(channel=channel, operation="poll", outcome="ok", duration_ms=Value(3))])
    assert VendorCall.objects.filter(channel=channel, duration_ms=3).count() == 1


def test_many_rows_are_written_as_bulk_create_writes_them_each_with_its_own_key(tenant):
    """Several rows in one statement (PostgreSQL: one array a column, the statement's text the
    same for any number of rows), each row read back with what was set on it, its database-assigned
    key set on its own instance."""
    files = [_file(tenant) for _ in range(3)]
    insert_rows(files)
    lanes = ["batch", "interactive", "batch"]
    made = [Task(tenant=tenant, file=files[n], kind="transcription", target_format=("txt", "srt", "json")[n],
                 params={"n": n, "nested": {"k": [n, None]}} if n != 1 else {}, lane_id=lanes[n], priority="batch",
                 deadline_at=timezone.now() + timedelta(hours=n + 1), due_at=timezone.now() if n != 2 else None,
                 callback_url="" if n else "https://example.com/hook", idempotency_key=f"key-{n}" if n != 1 else None,
                 estimated_units=n * 7 if n else None, deferred=n == 1, poll_interval_s=1.5 * n)
            for n in range(3)]
    def copy(task: Task, **changes) -> Task:
        return Task(**{**{f.attname: getattr(task, f.attname) for f in Task._meta.concrete_fields if f.attname != "id"},
                       **changes})

    theirs = [copy(task, idempotency_key=task.idempotency_key and f"{task.idempotency_key}-orm") for task in made]
    with transaction.atomic(), CaptureQueriesContext(connection) as statements:
        insert_rows(made)
        insert_rows([copy(made[0], idempotency_key=None) for _ in range(2)])
    Task.objects.bulk_create(theirs)
    skip = {"id", "idempotency_key", "created_at", "updated_at"}
    for ours, orm in zip(made, theirs, strict=True):
        assert {k: v for k, v in _values(Task.objects.get(pk=ours.pk)).items() if k not in skip} == \
            {k: v for k, v in _values(Task.objects.get(pk=orm.pk)).items() if k not in skip}
    events = [TaskEvent(task=task, from_state="", to_state="ACCEPTED", generation=0, actor="t", reason=f"r{n}",
                        data={"n": n}) for n, task in enumerate(made)]
    insert_rows(events)
    assert [(TaskEvent.objects.get(pk=e.pk).reason, TaskEvent.objects.get(pk=e.pk).data) for e in events] == \
        [("r0", {"n": 0}), ("r1", {"n": 1}), ("r2", {"n": 2})]  # each key read back onto its own row
    texts = [q["sql"] for q in statements.captured_queries]
    assert len(texts) == 2
    if connection.vendor == "postgresql":  # 3 rows or 2: the same statement, an array a column
        assert all("SELECT * FROM UNNEST(" in text and " VALUES " not in text for text in texts), texts


def test_the_embedded_brokers_message_is_written_and_taken_as_django_q2_writes_it():
    from django.conf import settings
    from django_q.brokers import get_broker
    from django_q.models import OrmQ

    if settings.REDIS_URL:
        pytest.skip("the embedded broker's: with REDIS_URL the broker is Redis")
    broker = get_broker("sluice-rows-probe")
    message_id = broker.enqueue("payload")
    assert OrmQ.objects.get(pk=message_id).key == "sluice-rows-probe"
    assert broker.queue_size() == 1
    with CaptureQueriesContext(connection) as statements:
        (taken_id, payload), = broker.dequeue()
    assert (taken_id, payload) == (message_id, "payload")
    assert [q["sql"].split()[0] for q in statements.captured_queries] == ["UPDATE"]  # found and claimed at once
    # Claimed: its lock moved a retry period ahead, so neither this cluster nor another takes it again.
    locked_until = OrmQ.objects.get(pk=message_id).lock
    assert timezone.now() + timedelta(seconds=settings.Q_CLUSTER["retry"] - 60) < locked_until
    assert (broker.queue_size(), broker.lock_size()) == (0, 1)
    assert broker.dequeue() is None


def test_a_lanes_message_is_taken_by_deleting_it_and_its_acknowledgement_writes_nothing():
    # A lane's messages are triggers (the dispatcher sends again a step it does not hear of):
    # one statement a message where a claim and an acknowledgement were two.
    from django.conf import settings
    from django_q.brokers import get_broker
    from django_q.models import OrmQ

    if settings.REDIS_URL:
        pytest.skip("the embedded broker's: with REDIS_URL the broker is Redis")
    broker = get_broker("interactive")
    message_id = broker.enqueue("payload")
    assert broker.queue_size() == 1
    with CaptureQueriesContext(connection) as statements:
        (taken_id, payload), = broker.dequeue()
        broker.acknowledge(taken_id)
    assert (taken_id, payload) == (message_id, "payload")
    assert [q["sql"].split()[0] for q in statements.captured_queries] == ["DELETE"]
    assert not OrmQ.objects.filter(pk=message_id).exists()
    assert (broker.queue_size(), broker.lock_size()) == (0, 0)
    assert broker.dequeue() is None


@pytest.mark.parametrize("key", ["sluice-rows-race", "batch"])  # claimed (a control cluster's), taken (a lane's)
def test_the_embedded_brokers_messages_are_taken_oldest_first_each_by_one_pusher_only(key):
    import threading

    from django.conf import settings
    from django.db import connections
    from django_q.brokers import get_broker

    if settings.REDIS_URL:
        pytest.skip("the embedded broker's: with REDIS_URL the broker is Redis")
    sent = [get_broker(key).enqueue(f"m{i}") for i in range(40)]
    assert get_broker(key).dequeue() == [(sent[0], "m0")]
    taken: list[list] = [[] for _ in range(4)]

    def pusher(into: list) -> None:
        broker = get_broker(key)
        try:
            while (claimed := broker.dequeue()) is not None:
                into.extend(claimed)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=pusher, args=(into,)) for into in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = sorted(message for into in taken for message in into)
    assert claimed == [(pk, f"m{i}") for i, pk in enumerate(sent)][1:]  # every one once, none twice


def test_select_reads_what_the_orm_reads(tenant):
    kept, deleted = _file(tenant), _file(tenant, deleted_at=timezone.now())
    FileVersion.objects.bulk_create([kept, deleted])
    found = select(FileVersion, "id IN (%s, %s) AND tenant_id = %s AND deleted_at IS NULL",
                   [("id", kept.pk), ("id", deleted.pk), ("tenant", tenant.pk)])
    assert [f.pk for f in found] == [kept.pk]
    assert _values(found[0]) == _values(FileVersion.objects.get(pk=kept.pk))
    assert found[0].precheck_findings["nested"] == {"k": [1, 2]} and found[0].prechecked_at.tzinfo is not None
    # Deferred fields are loaded on access, as the ORM's .only() defers them.
    (partial,) = select(FileVersion, "id = %s", [("id", kept.pk)], only=("sha256",),
                        extra={"twice": "t.size * 2"})
    assert partial.get_deferred_fields() >= {"label", "precheck_findings"}
    assert (partial.sha256, partial.twice, partial.label) == (kept.sha256, 24690, "a.wav")
    # A foreign key read as its own column, converted as the ORM converts it.
    (by_tenant,) = select(FileVersion, "id = %s", [("id", kept.pk)], only=("tenant",))
    assert by_tenant.tenant_id == tenant.pk and by_tenant.tenant == tenant


def test_select_reads_related_rows_in_its_statement_as_select_related_does(tenant, django_assert_num_queries):
    task = _task(tenant, lane=Lane.objects.get(pk="batch"))
    theirs = Task.objects.select_related("file", "lane", "channel").get(pk=task.pk)
    with django_assert_num_queries(1):
        (ours,) = select(Task, "t.id = %s", [("id", task.pk)], related=("file", "lane", "channel"),
                         extra={"file_size": "r_file.size"})
        assert _values(ours.file) == _values(theirs.file) and _values(ours.lane) == _values(theirs.lane)
        assert ours.channel is None and _values(ours) == _values(theirs) and ours.file_size == 12345


def test_update_changes_what_queryset_update_changes(tenant):
    from django.db.models import F

    from tasks.rows import matching, update

    task = _task(tenant)
    lane = Lane.objects.get(pk="batch")
    where, params = matching(Task, {"id": task.pk, "state": "ACCEPTED", "generation": 0, "lane": None})
    assert update(Task, {"lane": lane, "attempts": F("attempts") + 2, "params": {"x": [1]}}, where, params) == 1
    assert update(Task, {"attempts": F("attempts") + 2}, where, params) == 0  # lane is no longer NULL
    stored = Task.objects.get(pk=task.pk)
    assert (stored.lane_id, stored.attempts, stored.params) == ("batch", 2, {"x": [1]})
    # What it does not build is left to the ORM (update_sql says None, update refuses): nothing runs.
    from tasks.rows import update_sql

    for change in ({"attempts": F("attempts") * 2}, {"due_at": F("deadline_at") + timedelta(seconds=5)},
                   {"attempts": F("attempts") + True}, {"kind": lane}):
        assert update_sql(Task, change, "t.id = %s", [("id", task.pk)]) is None
        with pytest.raises(ValueError):
            update(Task, change, "t.id = %s", [("id", task.pk)])
    assert matching(Task, {"id": task.pk, "dispatched_at__isnull": True}) is None
    assert Task.objects.get(pk=task.pk).attempts == 2


def test_the_compare_and_set_writes_what_the_orm_wrote_and_keeps_its_own_keys(tenant):
    from django.db.models import F

    from tasks.lifecycle import task_update, transition

    task = _task(tenant)
    lane = Lane.objects.get(pk="batch")
    assert transition(task.pk, source="ACCEPTED", target="QUEUED", generation=0, actor="t", reason="r",
                      fields={"lane": lane, "attempts": F("attempts") + 1, "due_at": None})
    assert not transition(task.pk, source="ACCEPTED", target="QUEUED", generation=0, actor="t", reason="r")
    # A condition with a lookup goes through the ORM, with the same compare-and-set.
    assert task_update(task.pk, state="QUEUED", generation=1, expect={"dispatched_at__isnull": True}, params={"a": 1})
    assert not task_update(task.pk, state="QUEUED", generation=0, params={"a": 2})
    stored = Task.objects.get(pk=task.pk)
    assert (stored.state, stored.generation, stored.lane_id, stored.attempts, stored.params) == ("QUEUED", 1, "batch", 1, {"a": 1})
    assert TaskEvent.objects.filter(task=task, to_state="QUEUED").count() == 1
    with pytest.raises(TypeError):
        task_update(task.pk, state="QUEUED", generation=1, expect={"generation": 0}, params={})


def test_select_reads_the_reverse_side_of_a_one_to_one(django_assert_num_queries):
    from tasks.models import ChannelHealth

    with_health = VendorChannel.objects.create(name="rows-a", base_url="http://127.0.0.1:1", preference=1)
    ChannelHealth.objects.create(channel=with_health, retry_tokens=3)
    VendorChannel.objects.create(name="rows-b", base_url="http://127.0.0.1:1", preference=0)
    with django_assert_num_queries(1):
        found = {c.name: c for c in select(VendorChannel, "t.name IN (%s, %s)", [("name", "rows-a"), ("name", "rows-b")],
                                           related=("health",))}
        assert found["rows-a"].health.retry_tokens == 3 and getattr(found["rows-b"], "health", None) is None
        assert found["rows-a"].health.channel is found["rows-a"]


def test_every_channels_usage_in_one_statement_counts_what_the_orm_counts(tenant, django_assert_num_queries):
    """Admission's statement (built once, for any number of channels) against per-channel ORM
    counts: open, held-in-the-future and released slots, live and terminal jobs, in several lanes."""
    from django.db.models import Q

    from tasks.models import BudgetSlot, VendorJob
    from tasks.scheduling.budgets import JOB, UPLOAD, channels_usage
    from tasks.scheduling.channels import channel_rooms

    now = timezone.now()
    channels = list(VendorChannel.objects.order_by("name"))
    primary, other = channels[0], channels[1]
    tasks = [_task(tenant, lane_id=lane) for lane in ("interactive", "batch", "batch", "heavy")]
    slots = [(primary, JOB, tasks[0], None), (primary, UPLOAD, tasks[0], None), (primary, JOB, tasks[1], None),
             (primary, JOB, tasks[2], now + timedelta(minutes=5)), (primary, JOB, tasks[3], now - timedelta(seconds=1)),
             (other, UPLOAD, tasks[1], now + timedelta(minutes=5)), (other, JOB, tasks[2], None)]
    BudgetSlot.objects.bulk_create([BudgetSlot(channel=c, kind=k, task=t, released_at=r) for c, k, t, r in slots])
    for n, (channel, task, terminal) in enumerate([(primary, tasks[1], None), (primary, tasks[3], None),
                                                    (primary, tasks[0], now), (other, tasks[3], None)]):
        VendorJob.objects.create(task=task, channel=channel, vendor_job_id=f"job-{n}", client_ref=f"ref-{n}",
                                 terminal_at=terminal)
    with django_assert_num_queries(1):
        usages = channels_usage(channels)
    assert set(usages) == {c.name for c in channels}
    for channel in channels:
        held = BudgetSlot.objects.filter(Q(released_at__isnull=True) | Q(released_at__gt=timezone.now()), channel=channel)
        live = VendorJob.objects.filter(channel=channel, terminal_at__isnull=True).count()
        assert (usages[channel.name].jobs, usages[channel.name].uploads) == (
            held.filter(kind=JOB).count() + live, held.filter(kind=UPLOAD).count()), channel.name
    assert (usages[primary.name].jobs, usages[primary.name].uploads) == (5, 1)
    assert usages[primary.name].jobs_by_lane == {"interactive": 1, "batch": 3, "heavy": 1}
    assert (usages[other.name].jobs, usages[other.name].uploads) == (2, 1)
    assert channels_usage([]) == {}
    # The dispatcher reads the channels with their health and their usage in one statement.
    with django_assert_num_queries(1):
        rooms = channel_rooms()
    assert set(rooms) == {c.name for c in channels}
    for channel in channels:
        room, usage = rooms[channel.name], usages[channel.name]
        assert (room.free_jobs, room.free_uploads, room.free_by_row) == (
            usage.free_jobs(channel), usage.free_uploads(channel), usage.free_by_row(channel)), channel.name
    BudgetSlot.objects.all().delete()
    VendorJob.objects.all().delete()
    assert {name: (room.free_jobs, room.free_uploads) for name, room in channel_rooms().items()} == {
        c.name: (c.max_inflight_jobs, c.max_concurrent_uploads) for c in channels}, "nothing held: every slot is free"


def test_the_channels_usage_reads_the_open_slots_by_index_not_every_slot_ever_released(tenant):
    """Every finished task leaves its released slots behind: admission, which reads the usage on
    every pass under its lock, reads only the open ones, by a range of an index (its cost does
    not grow with the installation's history)."""
    from django.db import connections

    from tasks.models import BudgetSlot
    from tasks.scheduling.budgets import JOB, UPLOAD, _usage_sql, usage_sql

    channels = list(VendorChannel.objects.order_by("name"))
    names = [c.name for c in channels]
    # A day's history: every slot released but a few (the planner decides on statistics).
    task, long_ago = _task(tenant), timezone.now() - timedelta(days=1)
    BudgetSlot.objects.bulk_create([BudgetSlot(channel=channels[n % 2], kind=(JOB, UPLOAD)[n // 2 % 2], task=task,
                                               released_at=None if n < 4 else long_ago) for n in range(3000)])
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE tasks_budgetslot")
    by_name = (_usage_sql(connection.alias, len(channels)), [*names, *names, timezone.now(), *names])
    # As the dispatcher reads it: a JSON column of each channel's row.
    with_channels = (f"SELECT c.name, ({usage_sql(connection.alias, 'c.name')}) FROM tasks_vendorchannel c",
                     [timezone.now()])
    for sql, params in (by_name, with_channels):
        _reads_open_slots_by_index(connections[connection.alias], sql, params)


def _reads_open_slots_by_index(connection, sql: str, params: list) -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute(f"EXPLAIN QUERY PLAN {sql}", params)
            plan = [row[-1] for row in cursor.fetchall() if " s " in f" {row[-1]} "]
            assert plan and all("budgetslot_channel_open (channel_id=? AND released_at" in step for step in plan), plan
        else:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            nodes, reads = [plan[0]["Plan"]], []
            while nodes:
                node = nodes.pop()
                nodes += node.get("Plans", [])
                # A read of the slots: a scan of the table, or (a bitmap's) of one of its indexes.
                if (node.get("Relation Name") == "tasks_budgetslot" and node["Node Type"] != "Bitmap Heap Scan") or (
                        node["Node Type"] == "Bitmap Index Scan" and "budgetslot" in node.get("Index Name", "")):
                    reads.append((node["Node Type"], node.get("Index Name"), node.get("Index Cond", "")))
            assert len(reads) == 2 and all(name == "budgetslot_channel_open" and "released_at" in cond
                                           for _, name, cond in reads), reads


def test_an_inserts_values_are_prepared_as_the_fields_themselves_prepare_them(inline_queue, api):
    """insert_rows passes plain values on without walking each field's preparation: for every row
    a task leaves behind, and for values of other types than the database reads back (a numeric
    string, a bool, a lazy string, a UUID as text, another time zone), what it writes is what
    the field's own `get_db_prep_save(pre_save(...))` makes of them."""
    from datetime import timezone as tz

    from django.apps import apps
    from django.utils.functional import lazy
    from django_q.models import OrmQ

    from tasks.rows import _columns, _preparers
    from tests.conftest import run_until
    from tests.support.flows import submit_file

    def compare(obj) -> int:
        model = type(obj)
        fields, _ = _columns(model, "default", connection)
        if fields is None:
            return 0
        preparers = _preparers(model, "default", fields)
        ours = [prepare(obj, connection) for prepare in preparers]
        theirs = [f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields]
        # (The fields it leaves to their own chain are not compared: a secret encrypted with a
        # fresh nonce each time. A timestamp set on save is set anew by each: its type is.)
        kept = [i for i, prepare in enumerate(preparers) if prepare.__name__ != "full"]
        stamped = [i for i in kept if preparers[i].stamped]
        assert [ours[i] for i in kept if i not in stamped] == [theirs[i] for i in kept if i not in stamped], model.__name__
        assert [type(ours[i]) for i in kept] == [type(theirs[i]) for i in kept], model.__name__
        return len(kept)

    run_until(submit_file(api))
    checked = {model.__name__: sum(compare(obj) for obj in model.objects.all()[:20])
               for model in [*apps.get_app_config("tasks").get_models(), OrmQ]}
    assert all(checked[name] for name in ("Task", "TaskEvent", "FileVersion", "VendorCall", "VendorJob", "Attempt")), checked
    task = Task.objects.get()
    task.generation, task.attempts, task.kind = "3", True, lazy(lambda: "transcription", str)()
    task.file_id, task.lane_id = str(task.file_id), None
    task.deadline_at = task.deadline_at.astimezone(tz(timedelta(hours=5)))
    task.deferred, task.poll_interval_s, task.last_retry_after_s = 1, 5, "2.5"  # not a bool, not floats
    assert compare(task)
    task.deferred, task.callback_url, task.channel_id, task.poll_interval_s = True, "https://93.184.216.34/h", "primary", 2.5
    assert compare(task)
    fast = {f.name for f, prepare in zip(_columns(Task, "default", connection)[0],
                                         _preparers(Task, "default", _columns(Task, "default", connection)[0]),
                                         strict=True) if prepare.__name__ != "full"}
    assert {"created_at", "updated_at", "deferred", "poll_interval_s", "callback_url", "lane", "channel"} <= fast


@pytest.mark.parametrize("model", [Task, TaskEvent, "OrmQ", VendorCall])
def test_new_row_builds_what_the_model_builds(model, tenant):
    """new_row skips Model.__init__: every field must still start where the model starts it, a
    callable default called for each instance (never one object shared between rows)."""
    from django_q.models import OrmQ

    from tasks.rows import new_row

    model = OrmQ if model == "OrmQ" else model
    lane = Lane.objects.get(pk="batch")
    values = {Task: dict(tenant=tenant, file=_file(tenant), kind="transcription", lane=lane, idempotency_key="k"),
              TaskEvent: dict(task=Task(tenant=tenant), to_state="ACCEPTED", actor="api", data={"lane": "batch"}),
              OrmQ: dict(key="interactive", payload="p", lock=timezone.now()),
              VendorCall: dict(operation="create")}[model]
    built, expected = new_row(model, **values), model(**values)
    fresh = {f.attname for f in model._meta.concrete_fields if f.has_default() and callable(f.default)}
    assert {k: v for k, v in _values(built).items() if k not in fresh or isinstance(v, (dict, list))} == \
           {k: v for k, v in _values(expected).items() if k not in fresh or isinstance(v, (dict, list))}
    assert (built._state.adding, built._state.db) == (expected._state.adding, expected._state.db)
    for name, value in values.items():
        assert getattr(built, name) is value
    other = new_row(model, **values)
    for attname in fresh - set(values):
        if isinstance(getattr(built, attname), (dict, list)):
            assert getattr(built, attname) is not getattr(other, attname)
        elif attname == model._meta.pk.attname:
            assert getattr(built, attname) != getattr(other, attname)
