from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Sluice console"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(_ensure_roles, sender=self)


def _ensure_roles(sender, **kwargs) -> None:
    from console.roles import roles_ensure

    roles_ensure()
