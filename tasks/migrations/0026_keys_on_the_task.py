"""The tasks accepted with a key before 0025 get their fingerprints from the keys' records (a
chunk at a time, each its own statement: the records of 48 hours of keyed submissions), and the
keyed tasks an index by age, for the prune (CONCURRENTLY on PostgreSQL). Reversed, the records
are written again from the tasks, for a release that reads them. Run again after a failure, the
copy picks up where it stopped (an INVALID index left by an interrupted build is dropped first:
docs/deployment.md)."""

from django.db import migrations, models
from django.db.models import OuterRef, Subquery

from tasks.online_schema import AddIndexOnline

CHUNK = 1000


def copy_fingerprints(apps, schema_editor) -> int:
    Task = apps.get_model("tasks", "Task")
    IdempotencyRecord = apps.get_model("tasks", "IdempotencyRecord")
    alias = schema_editor.connection.alias
    records = IdempotencyRecord.objects.using(alias).filter(task__isnull=False).order_by("pk")
    copied, last = 0, 0
    while chunk := list(records.filter(pk__gt=last).values_list("pk", "task_id")[:CHUNK]):
        last = chunk[-1][0]
        copied += (Task.objects.using(alias)
                   .filter(pk__in=[task for _, task in chunk], idempotency_key__isnull=False,
                           idempotency_fingerprint__isnull=True)
                   .update(idempotency_fingerprint=Subquery(
                       IdempotencyRecord.objects.using(alias).filter(task=OuterRef("pk")).values("fingerprint")[:1])))
    return copied


def write_records(apps, schema_editor) -> None:
    Task = apps.get_model("tasks", "Task")
    IdempotencyRecord = apps.get_model("tasks", "IdempotencyRecord")
    alias = schema_editor.connection.alias
    keyed = (Task.objects.using(alias).filter(idempotency_key__isnull=False, idempotency_fingerprint__isnull=False)
             .values_list("pk", "tenant_id", "idempotency_key", "idempotency_fingerprint"))
    batch = []
    for pk, tenant, key, fingerprint in keyed.iterator(chunk_size=CHUNK):
        batch.append(IdempotencyRecord(tenant_id=tenant, key=key, fingerprint=fingerprint, task_id=pk))
        if len(batch) == CHUNK:
            IdempotencyRecord.objects.using(alias).bulk_create(batch, ignore_conflicts=True)
            batch = []
    IdempotencyRecord.objects.using(alias).bulk_create(batch, ignore_conflicts=True)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("tasks", "0025_task_idempotency_fingerprint")]

    operations = [
        migrations.RunPython(copy_fingerprints, write_records),
        AddIndexOnline(
            model_name="task",
            index=models.Index(condition=models.Q(("idempotency_key__isnull", False)), fields=["created_at"],
                               name="task_idempotency_kept"),
        ),
    ]
