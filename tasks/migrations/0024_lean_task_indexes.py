"""Fewer indexes on the task table, which every submission inserts into and every move updates:
the tenant's and the lane's own indexes go (the composite indexes lead with them); the channel's,
the vendor job's, the billing audit's, the start time's and the lease's hold only the tasks that
have one (none at intake). The new indexes are built before the old ones are dropped, both
CONCURRENTLY on PostgreSQL (tasks/online_schema.py)."""

import django.db.models.deletion
from django.db import migrations, models

from tasks.online_schema import AddIndexOnline, DropFieldIndex, RemoveIndexOnline


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('tasks', '0023_quarantine_held'),
    ]

    operations = [
        AddIndexOnline(
            model_name='task',
            index=models.Index(condition=models.Q(('lease_expires_at__isnull', False)), fields=['state', 'lease_expires_at'], name='task_lease_held'),
        ),
        AddIndexOnline(
            model_name='task',
            index=models.Index(condition=models.Q(('started_at__isnull', False)), fields=['started_at'], name='task_started'),
        ),
        AddIndexOnline(
            model_name='task',
            index=models.Index(condition=models.Q(('channel__isnull', False)), fields=['channel'], name='task_channel'),
        ),
        AddIndexOnline(
            model_name='task',
            index=models.Index(condition=models.Q(('vendor_job__isnull', False)), fields=['vendor_job'], name='task_vendor_job'),
        ),
        AddIndexOnline(
            model_name='task',
            index=models.Index(condition=models.Q(('billing_audit_due_at__isnull', False)), fields=['billing_audit_due_at'], name='task_billing_audit_due'),
        ),
        RemoveIndexOnline(
            model_name='task',
            name='tasks_task_state_162e68_idx',
        ),
        RemoveIndexOnline(
            model_name='task',
            name='task_started_at',
        ),
        DropFieldIndex(
            model_name='idempotencyrecord',
            name='tenant',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, to='tasks.tenant'),
        ),
        DropFieldIndex(
            model_name='task',
            name='billing_audit_due_at',
            field=models.DateTimeField(blank=True, help_text='The vendor is asked again then for every job of the operation: a duplicate audit that could not list them, or the follow-up after an ambiguous create (a create the vendor runs late).', null=True),
        ),
        DropFieldIndex(
            model_name='task',
            name='channel',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='tasks', to='tasks.vendorchannel'),
        ),
        DropFieldIndex(
            model_name='task',
            name='lane',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='tasks', to='tasks.lane'),
        ),
        DropFieldIndex(
            model_name='task',
            name='tenant',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='tasks', to='tasks.tenant'),
        ),
        DropFieldIndex(
            model_name='task',
            name='vendor_job',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='tasks.vendorjob'),
        ),
    ]
