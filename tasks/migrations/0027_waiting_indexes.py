"""A lane's waiting tasks indexed in the two orders admission reads them (the oldest first, for
the intake gate; admission's own order, for the heads of a pass), so that the first ones are the
first rows of a range however long the backlog: PostgreSQL does not take `dispatched_at IS NULL`
as an equality that keeps the (lane, state, dispatched_at, created_at) index's order, and read and
sorted every waiting task of the lane instead. Built CONCURRENTLY on PostgreSQL."""

from django.db import migrations, models

from tasks.online_schema import AddIndexOnline


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("tasks", "0026_keys_on_the_task")]

    operations = [
        AddIndexOnline(
            model_name="task",
            index=models.Index(condition=models.Q(("dispatched_at__isnull", True)), fields=["lane", "state", "created_at"],
                               name="task_lane_waiting_oldest"),
        ),
        AddIndexOnline(
            model_name="task",
            index=models.Index(
                models.F("lane"), models.F("state"),
                models.ExpressionWrapper(models.Q(("dispatch_deadline_at__isnull", True)), output_field=models.BooleanField()),
                models.F("dispatch_deadline_at"), models.F("queued_at"), models.F("created_at"),
                condition=models.Q(("dispatched_at__isnull", True)), name="task_lane_waiting_heads"),
        ),
    ]
