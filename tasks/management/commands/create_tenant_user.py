from django.core.management.base import BaseCommand, CommandError

from tasks.models import Tenant
from tasks.services.tenancy import tenant_user_ensure


class Command(BaseCommand):
    help = "Create or update a business user of a tenant; prints a new password alone on the last line."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--tenant", required=True)

    def handle(self, *args, username: str, tenant: str, **options):
        record = Tenant.objects.filter(name=tenant).first()
        if record is None:
            raise CommandError(f"no tenant {tenant!r}: create it with `manage.py create_tenant {tenant}`")
        user, password = tenant_user_ensure(username=username, tenant=record)
        self.stdout.write(f"user {user.username} of tenant {record.name}; new password:")
        self.stdout.write(password)
