"""What a fresh installation needs: default vendor channels and the safety-net schedule."""

from __future__ import annotations

from django.conf import settings

from tasks.models import VendorChannel
from tasks.observability import log_event
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
    local_engine_ensure()


def local_engine_ensure() -> VendorChannel:
    """The local conversion engine's channel: first choice for conversions where LibreOffice and
    poppler are installed (the fake vendor's channels stay behind it as fallbacks), disabled with
    its reason where they are not."""
    from tasks import engine

    available = settings.LOCAL_ENGINE == "auto" and engine.installed()
    channel, created = VendorChannel.objects.get_or_create(
        name="local",
        defaults=dict(dialect="local", base_url="", api_key="-", mode=VendorChannel.Mode.TWO_STEP, kinds=["conversion"],
                      preference=5, enabled=available, max_inflight_jobs=settings.ENGINE_SLOTS, lane_slots=settings.ENGINE_LANE_SLOTS,
                      max_concurrent_uploads=max(settings.ENGINE_SLOTS * 2, 2), reserved_for_interactive=1),
    )
    if not created and not available and channel.enabled:
        VendorChannel.objects.filter(pk=channel.pk).update(enabled=False)  # it was uninstalled
    if not available:
        log_event("local_engine_unavailable", 30, reason="off" if settings.LOCAL_ENGINE == "off" else
                  "LibreOffice or poppler-utils is not installed: conversions go to the other channels (make engine)")
    health_for(channel)
    if available:
        from tasks.services.quarantine import poison_reevaluate

        poison_reevaluate()  # an upgraded engine judges again what the previous one could not convert
    channel.refresh_from_db()
    return channel


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
