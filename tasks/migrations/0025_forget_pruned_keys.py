"""Tasks whose Idempotency-Key record was pruned before the prune also forgot the task's copy of
the key: that copy (unique per tenant) made the key's next use fail with a 500. They forget it
now; from here on the prune forgets both at once (tasks/services/housekeeping.py)."""

from django.db import migrations
from django.db.models import Exists, OuterRef


def forget_pruned_keys(apps, schema_editor) -> int:
    Task = apps.get_model("tasks", "Task")
    IdempotencyRecord = apps.get_model("tasks", "IdempotencyRecord")
    return (Task.objects.using(schema_editor.connection.alias)
            .filter(idempotency_key__isnull=False)
            .exclude(Exists(IdempotencyRecord.objects.filter(task=OuterRef("pk"))))
            .update(idempotency_key=None))


class Migration(migrations.Migration):

    dependencies = [("tasks", "0024_lean_task_indexes")]

    operations = [migrations.RunPython(forget_pruned_keys, migrations.RunPython.noop)]
