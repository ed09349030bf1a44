from django.core.management.base import BaseCommand, CommandError

from tasks.services.tenancy import tenant_ensure, token_issue


class Command(BaseCommand):
    help = "Create the tenant if missing and issue a new API token (printed alone on the last line)."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name: str, **options):
        from django.utils.text import slugify

        if slugify(name) != name:
            raise CommandError(f"tenant names are slugs (lowercase letters, digits, -): try {slugify(name)!r}")
        tenant = tenant_ensure(name=name)
        issued = token_issue(tenant=tenant, name="cli")
        self.stdout.write(f"tenant {tenant.name} ({tenant.pk}); new API token:")
        self.stdout.write(issued.token)
