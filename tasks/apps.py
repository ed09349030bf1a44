from django.apps import AppConfig
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
