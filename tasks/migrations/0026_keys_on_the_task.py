"""An Idempotency-Key lives on its task alone: the task gets the fingerprint of the request that
made it (copied from the key's record for the tasks accepted before), and an index of the keyed
tasks by age for the prune. Intake no longer writes a record per key (an INSERT and three index
entries a submission); the records table stays one release, for the tasks a process of the
previous release accepts while this runs (tasks/models.py, IdempotencyRecord). The column is
nullable so that those processes' INSERTs, which do not name it, still work."""

from django.db import migrations, models
from django.db.models import OuterRef, Subquery

from tasks.online_schema import AddIndexOnline


def copy_fingerprints(apps, schema_editor) -> int:
    Task = apps.get_model("tasks", "Task")
    IdempotencyRecord = apps.get_model("tasks", "IdempotencyRecord")
    return (Task.objects.using(schema_editor.connection.alias)
            .filter(idempotency_key__isnull=False, idempotency_fingerprint__isnull=True)
            .update(idempotency_fingerprint=Subquery(
                IdempotencyRecord.objects.filter(task=OuterRef("pk")).values("fingerprint")[:1])))


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("tasks", "0025_forget_pruned_keys")]

    operations = [
        migrations.AddField(
            model_name="task",
            name="idempotency_fingerprint",
            field=models.CharField(blank=True, max_length=64, null=True),
        ),
        migrations.RunPython(copy_fingerprints, migrations.RunPython.noop),
        AddIndexOnline(
            model_name="task",
            index=models.Index(condition=models.Q(("idempotency_key__isnull", False)), fields=["created_at"],
                               name="task_idempotency_kept"),
        ),
    ]
