"""What a fresh installation needs: default vendor channels and the safety-net schedule."""

from __future__ import annotations

from django.conf import settings

from tasks.models import VendorChannel
from tasks.vendors.breaker import health_for
from tasks.vendors.dialects import DIALECTS

KINDS = ["transcription", "conversion"]


def channels_ensure() -> None:
    """A primary (two-step) and a fallback (inline) channel, pointing at the bundled fake vendor, in
    the dialects the environment names (an AssemblyAI channel is always two-step transcription)."""
    defaults = {
        "primary": dict(base_url=settings.VENDOR_PRIMARY_URL, dialect=settings.VENDOR_PRIMARY_DIALECT,
                        mode=VendorChannel.Mode.TWO_STEP, preference=10),
        "fallback": dict(base_url=settings.VENDOR_FALLBACK_URL, dialect=settings.VENDOR_FALLBACK_DIALECT,
                         mode=VendorChannel.Mode.INLINE, preference=20),
    }
    for name, values in defaults.items():
        capabilities = DIALECTS[values["dialect"]][1]
        if values["mode"] not in capabilities.upload_modes:
            values["mode"] = VendorChannel.Mode.TWO_STEP
        kinds = [k for k in KINDS if k in capabilities.kinds]
        channel, _ = VendorChannel.objects.get_or_create(
            name=name,
            defaults=dict(api_key=settings.VENDOR_API_KEY, webhook_secret=settings.VENDOR_WEBHOOK_SECRET, kinds=kinds, **values),
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
