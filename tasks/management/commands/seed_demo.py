"""Demo tenants, users and staff for `make run` (faker-generated names, stable across runs)."""

import os

from django.core.management.base import BaseCommand
from django.utils.text import slugify
from faker import Faker

from console.roles import ROLES
from console.staff import staff_ensure
from tasks.services.tenancy import tenant_ensure, tenant_user_ensure, token_issue


class Command(BaseCommand):
    help = "Create demo tenants (with API tokens and users) and one console user per role; print the logins."

    def add_arguments(self, parser):
        parser.add_argument("--tenants", type=int, default=2)

    def handle(self, *args, tenants: int, **options):
        fake = Faker()
        fake.seed_instance(2026)
        lines = ["", "Demo logins (new passwords and tokens are issued on every run):", ""]
        for _ in range(tenants):
            name = slugify(fake.company())[:40]
            tenant = tenant_ensure(name=name)
            token = token_issue(tenant=tenant, name="demo").token
            username = f"{fake.user_name()}@{name}"[:150]
            _, password = tenant_user_ensure(username=username, tenant=tenant)
            lines += [f"tenant {name}", f"  API token:   {token}", f"  portal user: {username} / {password}", ""]
        for role in ROLES:
            _, password = staff_ensure(username=role, role=role, actor="seed_demo")
            lines.append(f"console {role:<9} {role} / {password}")
        base = f"http://127.0.0.1:{os.environ.get('SLUICE_PORT') or 8000}"  # the port the Procfile binds
        lines += ["", f"Portal: {base}/   Console: {base}/console/", ""]
        self.stdout.write("\n".join(lines))
