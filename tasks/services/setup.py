"""What a fresh installation needs: default vendor channels and the safety-net schedule."""

from __future__ import annotations

from django.conf import settings

from tasks.models import VendorChannel
from tasks.vendors.breaker import health_for

KINDS = ["transcription", "conversion"]


def channels_ensure() -> None:
    """A primary (two-step) and a fallback (inline) channel, pointing at the bundled fake vendor."""
    defaults = {
        "primary": dict(base_url=settings.VENDOR_PRIMARY_URL, mode=VendorChannel.Mode.TWO_STEP, preference=10),
        "fallback": dict(base_url=settings.VENDOR_FALLBACK_URL, mode=VendorChannel.Mode.INLINE, preference=20),
    }
    for name, values in defaults.items():
        channel, _ = VendorChannel.objects.get_or_create(
            name=name,
            defaults=dict(api_key=settings.VENDOR_API_KEY, webhook_secret=settings.VENDOR_WEBHOOK_SECRET, kinds=KINDS, **values),
        )
        health_for(channel)


def schedules_ensure() -> None:
    from django_q.models import Schedule

    Schedule.objects.update_or_create(
        name="sluice-sweep",
        defaults=dict(func="tasks.workers.run_sweep", schedule_type=Schedule.MINUTES, minutes=1, repeats=-1),
    )
    Schedule.objects.update_or_create(
        name="sluice-housekeeping",
        defaults=dict(func="tasks.workers.run_housekeeping", schedule_type=Schedule.MINUTES, minutes=10, repeats=-1),
    )
