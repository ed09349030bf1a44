from django.apps import AppConfig
from django.db.backends.signals import connection_created
from django.db.models.signals import post_delete, post_migrate, post_save


class TasksConfig(AppConfig):
    name = "tasks"
    verbose_name = "Sluice tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from tasks import costs, q2pool
        from tasks.models import QuotaOverride, TenantQuota
        from tasks.scheduling.quotas import quotas_forget

        post_migrate.connect(_ensure_defaults, sender=self)
        post_migrate.connect(_note_trigger_current, sender=self)
        connection_created.connect(_note_triggers_read, dispatch_uid="note-triggers-read")
        # A process's cached quotas are forgotten when it changes one (others within seconds).
        for model in (TenantQuota, QuotaOverride):
            post_save.connect(quotas_forget, sender=model, dispatch_uid=f"quotas-forget-save-{model.__name__}")
            post_delete.connect(quotas_forget, sender=model, dispatch_uid=f"quotas-forget-delete-{model.__name__}")
        costs.install()  # only where SLUICE_COUNT_DIR is set (the benchmark)
        # Before any qcluster spawns a worker: an idle worker's death must not stop its lane,
        # and a best-effort lane's cluster yields the CPU to interactive work.
        q2pool.install()
        q2pool.lane_priority()


def _ensure_defaults(sender, **kwargs) -> None:
    """Lanes, vendor channels and the safety-net schedule every installation starts with."""
    from tasks.scheduling.lanes import lanes_ensure
    from tasks.services.setup import channels_ensure, schedules_ensure

    lanes_ensure()
    channels_ensure()
    schedules_ensure()


def _note_trigger_current(sender, using: str = "default", **kwargs) -> None:
    """SQLite's triggers that write what a task's note carries name the columns of the rows they
    write: written again after a migration that changed them (where the migrations made them)."""
    from django.db import connections

    from tasks import lifecycle

    connection = connections[using]
    if connection.vendor != "sqlite":
        return
    if not lifecycle.note_triggers_current(using):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM sqlite_master WHERE type = 'trigger' AND name = %s", [lifecycle.HISTORY_TRIGGER])
            if cursor.fetchone() is not None:
                for name, sql in lifecycle.note_triggers_sql(using).items():
                    cursor.execute(f"DROP TRIGGER IF EXISTS {name}")
                    cursor.execute(sql)
    lifecycle.note_triggers_read(using)


def _note_triggers_read(sender, connection, **kwargs) -> None:
    """Whether the triggers are this code's is asked as the process's first connection opens, not
    in the middle of a step (one statement a process)."""
    if connection.vendor == "sqlite":
        from tasks import lifecycle

        lifecycle.note_triggers_read(connection.alias, unless_known=True)
