"""An Idempotency-Key lives on its task alone: the task gets the fingerprint of the request that
used the key. Nullable, so that the INSERTs of the previous release's processes, which do not
name it, still work while this release is rolled out (tasks/models.py, IdempotencyRecord)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [("tasks", "0024_lean_task_indexes")]

    operations = [
        migrations.AddField(
            model_name="task",
            name="idempotency_fingerprint",
            field=models.CharField(blank=True, max_length=64, null=True),
        ),
    ]
