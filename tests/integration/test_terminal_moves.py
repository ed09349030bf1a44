"""A terminal move and its outbox: the move's own statement says whether there is anything to
write there (a callback URL, the task's or its tenant's, or an older event still pending), so a
task with neither reads nothing more; one with either gets its notification as before."""

from __future__ import annotations

from datetime import timedelta

from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks.models import FileVersion, Notification, Task, TaskEvent
from tasks.services.outcomes import task_move
from tasks.states import State


def _task(tenant, **extra) -> Task:
    file = FileVersion.objects.create(tenant=tenant, sha256="cd" * 32, size=10, detected_type="audio/x-wav",
                                      extension="wav", label="a.wav", storage_name="x")
    return Task.objects.create(tenant=tenant, file=file, kind="transcription", target_format="txt",
                               deadline_at=timezone.now() + timedelta(hours=1), **extra)


def _fail(task: Task):
    return task_move(task.pk, source=State.ACCEPTED, target=State.FAILED, generation=task.generation, actor="test",
                     reason="refused", fields=dict(error_code="refused"))


def test_a_terminal_move_of_a_task_nobody_listens_to_reads_nothing_after_it(tenant):
    task = _task(tenant)
    with CaptureQueriesContext(connection) as statements:
        moved = _fail(task)
    assert moved is not None and moved.said == (0,)
    assert not [q["sql"] for q in statements.captured_queries if q["sql"].lstrip().upper().startswith("SELECT")]
    assert Task.objects.get(pk=task.pk).state == State.FAILED
    assert TaskEvent.objects.filter(task=task, to_state=State.FAILED).count() == 1
    assert not Notification.objects.filter(task=task).exists()


def test_a_terminal_move_writes_the_notification_of_a_task_or_tenant_with_a_callback(tenant):
    listened = _task(tenant, callback_url="https://hooks.example.com/task")
    assert _fail(listened).said == (1,)
    tenant.callback_url = "https://hooks.example.com/tenant"
    tenant.save()
    by_tenant = _task(tenant)
    assert _fail(by_tenant).said == (1,)
    sent = {n.task_id: (n.url, n.event_type, n.status) for n in Notification.objects.all()}
    assert sent == {listened.pk: ("https://hooks.example.com/task", "task.failed", Notification.Status.PENDING),
                    by_tenant.pk: ("https://hooks.example.com/tenant", "task.failed", Notification.Status.PENDING)}


def test_an_older_event_still_pending_is_superseded_though_nobody_listens_any_more(tenant):
    # A dead letter replayed after its failure was announced: the URL has since been removed.
    task = _task(tenant)
    older = Notification.objects.create(task=task, generation=task.generation, tenant=tenant,
                                        url="https://hooks.example.com/gone", event_type="task.failed", payload={},
                                        next_attempt_at=timezone.now())
    Task.objects.filter(pk=task.pk).update(generation=task.generation + 1)
    task.refresh_from_db()
    moved = _fail(task)
    assert moved.said == (1,)
    older.refresh_from_db()
    assert older.status == Notification.Status.SUPERSEDED
    assert Notification.objects.filter(task=task).count() == 1
