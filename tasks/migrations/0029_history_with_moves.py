"""SQLite writes a move's history entries in the move's own statement, as PostgreSQL's WITH does:
the UPDATE writes them into the task's new `moves_note` column and a trigger copies them into the
history (tasks/lifecycle.py). A nullable column without a default: SQLite adds it in place
(ALTER TABLE ... ADD COLUMN), without the rebuild of the table that would drop its triggers."""

from django.db import migrations, models

from tasks import lifecycle


class Migration(migrations.Migration):
    dependencies = [("tasks", "0028_tick_indexes")]

    operations = [
        migrations.AddField(
            model_name="task",
            name="moves_note",
            field=models.TextField(
                blank=True, editable=False, null=True,
                help_text="SQLite: the history entries of the row's last recorded write, which a trigger copies into the "
                          "history as the write is made (tasks.lifecycle). Always empty on PostgreSQL.",
            ),
        ),
        migrations.RunPython(lifecycle.history_trigger_install, lifecycle.history_trigger_remove),
    ]
