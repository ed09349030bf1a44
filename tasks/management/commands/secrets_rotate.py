"""`python manage.py secrets_rotate`: every stored secret encrypted again with the first key of
SLUICE_SECRETS_KEYS (see tasks/secrets.py for the rotation steps)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from tasks.models import VendorChannel
from tasks.secrets import SecretUnreadable, rotated
from tasks.services.audit import audit

FIELDS = ("api_key", "webhook_secret")


class Command(BaseCommand):
    help = "Re-encrypt every stored secret with the first key of SLUICE_SECRETS_KEYS."

    def handle(self, *args, **options):
        count = 0
        with transaction.atomic():
            for name in VendorChannel.objects.values_list("name", flat=True):
                stored = dict(zip(FIELDS, _raw(name)))
                try:
                    values = {field: rotated(value) for field, value in stored.items()}
                except SecretUnreadable:
                    raise CommandError(f"channel {name!r}: a secret cannot be decrypted with any key in "
                                       "SLUICE_SECRETS_KEYS; put the old key back after the new one.") from None
                # Written as they are: already sealed, so the field stores them unchanged.
                VendorChannel.objects.filter(name=name).update(**values)
                count += 1
            audit(actor="manage.py secrets_rotate", action="secrets_rotate", target_type="vendorchannel", done=count)
        self.stdout.write(f"{count} channel(s) re-encrypted with the first key.")


def _raw(name: str) -> tuple[str, ...]:
    from django.db import connection

    table = VendorChannel._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(FIELDS)} FROM {table} WHERE name = %s", [name])
        return cursor.fetchone()
