from django.core.management.base import BaseCommand

from console.roles import ROLES
from console.staff import staff_ensure


class Command(BaseCommand):
    help = "Create or update a console user with a role; prints a new password alone on the last line."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", required=True, choices=ROLES)

    def handle(self, *args, username: str, role: str, **options):
        user, password = staff_ensure(username=username, role=role, actor="cli")
        self.stdout.write(f"console user {user.username} with role {role}; new password:")
        self.stdout.write(password)
