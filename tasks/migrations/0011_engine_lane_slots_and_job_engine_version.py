from django.conf import settings
from django.db import migrations, models


def engine_lane_rows(apps, schema_editor):
    """The local engine's channel gets its per-lane converter rows (and the total they add up to)."""
    VendorChannel = apps.get_model("tasks", "VendorChannel")
    VendorChannel.objects.filter(name="local", dialect="local").update(
        lane_slots=settings.ENGINE_LANE_SLOTS, max_inflight_jobs=settings.ENGINE_SLOTS,
        max_concurrent_uploads=max(settings.ENGINE_SLOTS * 2, 2),
    )


class Migration(migrations.Migration):
    dependencies = [("tasks", "0010_local_engine_dialect")]

    operations = [
        migrations.AddField(
            model_name="vendorchannel",
            name="lane_slots",
            field=models.JSONField(
                blank=True, default=dict,
                help_text='Jobs at most at once per lane, within the budget above, e.g. {"interactive+batch": 2, "heavy": 1}: '
                          'a row names one lane or several joined by "+" (which then share it); lanes not named share the rest.',
            ),
        ),
        migrations.AddField(
            model_name="vendorjob",
            name="engine_version",
            field=models.CharField(blank=True, help_text="What processed it, where the vendor says (the local engine).", max_length=64),
        ),
        migrations.RunPython(engine_lane_rows, migrations.RunPython.noop),
    ]
