"""SQLite writes what commits with a move (an admission's slots and attempt, the attempt's end, a
slot's release, the step's vendor calls) in the move's own statement, as PostgreSQL's WITH does:
the move's `moves_note` carries them and the trigger that writes its history entries writes them
too; a new task's INSERT carries its first history entry and its pre-check's message the same
way (tasks/lifecycle.py). The triggers are written again, with the tables they now write."""

from django.db import migrations

from tasks import lifecycle


class Migration(migrations.Migration):
    dependencies = [("tasks", "0029_history_with_moves"), ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more")]

    operations = [migrations.RunPython(lifecycle.history_trigger_install, lifecycle.history_trigger_install)]
