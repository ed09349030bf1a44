"""What a dispatcher's tick asks several times a second, indexed: a waiting task past its queue
deadline, a deferred task waiting for room, a start sent and not heard of. Without these,
PostgreSQL read every task of a backlog to answer no, three times a pass. Built CONCURRENTLY on
PostgreSQL."""

from django.db import migrations, models

from tasks.online_schema import AddIndexOnline


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("tasks", "0027_waiting_indexes")]

    operations = [
        AddIndexOnline(
            model_name="task",
            index=models.Index(condition=models.Q(("dispatched_at__isnull", True)), fields=["state", "queue_deadline_at"],
                               name="task_waiting_deadline"),
        ),
        AddIndexOnline(
            model_name="task",
            index=models.Index(condition=models.Q(("deferred", True)), fields=["state", "lane", "created_at"],
                               name="task_deferred"),
        ),
        AddIndexOnline(
            model_name="task",
            index=models.Index(condition=models.Q(("dispatched_at__isnull", False)), fields=["state", "enqueued_at"],
                               name="task_dispatched_enqueued"),
        ),
    ]
