"""Sluice's domain data. The task table is the truth; queue messages are only triggers.

Only tasks/lifecycle.py writes Task.state and Task.generation.
"""

from __future__ import annotations

import secrets
import uuid

from django.conf import settings
from django.db import models
from django.db.models import ExpressionWrapper, F, Q
from django.utils import timezone

from tasks.secrets import SecretField
from tasks.states import State


def _new_secret() -> str:
    return secrets.token_hex(32)


class Tenant(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=64, unique=True)
    callback_url = models.URLField(blank=True, help_text="Terminal task events are POSTed here.")
    callback_secret = models.CharField(max_length=64, default=_new_secret, editable=False)
    result_retention_days = models.PositiveIntegerField(default=30)
    file_retention_days = models.PositiveIntegerField(
        default=30, help_text="Uploaded originals are deleted this long after upload, once no task needs them."
    )
    dead_letter_retention_days = models.PositiveIntegerField(default=90, help_text="Dead letters are purged after this.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A business user belongs to exactly one tenant."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"


class ApiToken(models.Model):
    """A bearer token of one tenant; only its SHA-256 is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tokens")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True)
    token_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.tenant} token {self.prefix}…"


class FileVersion(models.Model):
    """An immutable stored upload. Its path derives from its id, never from the client's name."""

    class Precheck(models.TextChoices):
        PENDING = "pending"
        PASSED = "passed"
        QUARANTINED = "quarantined"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    sha256 = models.CharField(max_length=64)
    size = models.BigIntegerField()
    detected_type = models.CharField(max_length=100)
    extension = models.CharField(max_length=16, blank=True, help_text="From the display label, lowercased.")
    label = models.CharField(max_length=255, blank=True, help_text="Display label only; never a path.")
    storage_name = models.CharField(max_length=100, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    precheck_state = models.CharField(max_length=16, choices=Precheck.choices, default=Precheck.PENDING)
    precheck_findings = models.JSONField(default=dict, blank=True)
    precheck_version = models.CharField(max_length=32, blank=True)
    prechecked_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "sha256"]),
            # Retention's sweep: a tenant's files still kept, oldest first (not every file ever uploaded).
            models.Index(fields=["tenant", "created_at"], condition=models.Q(deleted_at__isnull=True),
                         name="fileversion_kept"),
        ]

    def __str__(self) -> str:
        return f"file {self.id}"

    @property
    def path(self):
        return settings.FILES_DIR / self.storage_name


class Lane(models.Model):
    """A scheduling lane. Each lane has its own django-q2 cluster of worker processes."""

    class Overflow(models.TextChoices):
        REJECT = "reject"
        SHED_OLDEST = "shed-oldest"
        DEFER = "defer"

    name = models.SlugField(max_length=32, primary_key=True)
    max_running = models.PositiveIntegerField(default=8)
    max_queued = models.PositiveIntegerField(default=1000)
    queue_deadline_s = models.FloatField(default=600, help_text="Longest wait before an attempt starts.")
    execution_timeout_s = models.FloatField(default=1800, help_text="Longest single attempt.")
    overflow_policy = models.CharField(max_length=16, choices=Overflow.choices, default=Overflow.REJECT)
    early_close_pct = models.PositiveIntegerField(
        default=100, help_text="Admission closes at this % of max_queued (best-effort lanes: e.g. 80)."
    )
    aging_s = models.FloatField(
        default=60, help_text="A tenant below its fair share whose oldest task waited this long goes first."
    )
    urgency_s = models.FloatField(
        default=60, help_text="A task this close to its deadline goes before fair share (earliest deadline first)."
    )
    oldest_wait_limit_s = models.FloatField(
        null=True, blank=True, help_text="Admission closes while the oldest queued task has waited longer (empty: off)."
    )
    busy_close_pct = models.PositiveIntegerField(
        default=0, help_text="Admission closes while this % of max_running is busy and work already waits (0: off)."
    )
    dispatch_order = models.PositiveIntegerField(default=100, help_text="Lower lanes get free slots first.")
    paused = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.name


class TenantQuota(models.Model):
    """Limits of one tenant; null means unlimited. Overrides apply on top while active."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    max_queued = models.PositiveIntegerField(null=True, blank=True)
    max_running = models.PositiveIntegerField(null=True, blank=True)
    submissions_per_minute = models.PositiveIntegerField(null=True, blank=True)
    bytes_per_day = models.BigIntegerField(null=True, blank=True)
    units_per_day = models.PositiveIntegerField(null=True, blank=True)
    lane_weights = models.JSONField(default=dict, blank=True, help_text='e.g. {"batch": 3}; default weight 1.')
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"quota of {self.tenant}"


class QuotaOverride(models.Model):
    QUOTA_FIELDS = ("max_queued", "max_running", "submissions_per_minute", "bytes_per_day", "units_per_day")

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quota_overrides")
    field = models.CharField(max_length=32, choices=[(f, f) for f in QUOTA_FIELDS])
    value = models.BigIntegerField(null=True, blank=True, help_text="Empty: unlimited while active.")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    reason = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "ends_at"])]

    def __str__(self) -> str:
        return f"{self.tenant}.{self.field}={self.value} until {self.ends_at:%Y-%m-%d %H:%M}"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        if self.starts_at and self.ends_at and self.ends_at <= self.starts_at:
            raise ValidationError({"ends_at": "An override must end after it starts."})


class VendorChannel(models.Model):
    """Configuration of one vendor endpoint. Runtime health lives in ChannelHealth."""

    class Mode(models.TextChoices):
        TWO_STEP = "two_step"
        INLINE = "inline"

    class UploadTimeout(models.TextChoices):
        SIZE_DERIVED = "size_derived"
        FIXED = "fixed"

    class Dialect(models.TextChoices):
        """Which adapter speaks for the channel (tasks/vendors/dialects.py)."""

        SLUICE = "sluice", "Sluice vendor API (shared/contracts/vendor-api.md)"
        ASSEMBLYAI = "assemblyai", "AssemblyAI v2"
        LOCAL = "local", "Local conversion engine (LibreOffice + poppler, no HTTP)"
        AWS_TRANSCRIBE = "aws_transcribe", "AWS Transcribe (media through S3, jobs by unique name)"

    name = models.SlugField(max_length=32, primary_key=True)
    dialect = models.CharField(max_length=32, choices=Dialect.choices, default=Dialect.SLUICE)
    capability_overrides = models.JSONField(
        default=dict, blank=True,
        help_text='Declare this vendor weaker than its dialect, e.g. {"reconcile_by": "none"} when its job list cannot be trusted.',
    )
    base_url = models.URLField(blank=True, help_text="The vendor's API root (none for the local engine).")
    # Write-only secrets, encrypted at rest (tasks/secrets.py).
    api_key = SecretField()
    webhook_secret = SecretField(blank=True)
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.TWO_STEP)
    http2 = models.BooleanField(default=False, help_text="Speak HTTP/2 to this vendor (prior knowledge on http://, negotiated on https://).")
    dialect_settings = models.JSONField(
        default=dict, blank=True,
        help_text='What the dialect needs beyond the base URL, e.g. for aws_transcribe {"region": "eu-west-1", '
                  '"media_bucket": "my-media", "output_bucket": "my-transcripts", "prefix": "sluice/", '
                  '"s3_endpoint_url": "", "language_code": "en-US"} (the API key is ACCESS_KEY_ID:SECRET_ACCESS_KEY).',
    )
    kinds = models.JSONField(default=list, help_text='Kinds served, e.g. ["transcription", "conversion"].')
    preference = models.PositiveIntegerField(default=100, help_text="Lower goes first; higher ones are fallbacks.")
    enabled = models.BooleanField(default=True)
    # Budgets held across every process (enforced in the database).
    max_inflight_jobs = models.PositiveIntegerField(default=20)
    max_concurrent_uploads = models.PositiveIntegerField(default=4)
    reserved_for_interactive = models.PositiveIntegerField(
        default=2, help_text="Job and upload slots only the interactive lane may take (at most half of each budget), so batch floods cannot starve it."
    )
    lane_slots = models.JSONField(
        default=dict, blank=True,
        help_text='Jobs at most at once per lane, within the budget above, e.g. {"interactive+batch": 2, "heavy": 1}: '
                  'a row names one lane or several joined by "+" (which then share it); lanes not named share the rest.',
    )
    # Time layers (nominal seconds; multiplied by the time scale).
    connect_timeout_s = models.FloatField(default=5)
    status_timeout_s = models.FloatField(default=10)
    result_timeout_s = models.FloatField(default=30)
    upload_timeout_policy = models.CharField(
        max_length=16, choices=UploadTimeout.choices, default=UploadTimeout.SIZE_DERIVED
    )
    upload_buffer_s = models.FloatField(default=5, help_text="Fixed acceptance buffer.")
    upload_bandwidth_bytes_s = models.FloatField(default=1024 * 1024, help_text="Bandwidth estimate.")
    upload_timeout_floor_s = models.FloatField(default=10)
    upload_timeout_cap_s = models.FloatField(default=3600)
    upload_fixed_timeout_s = models.FloatField(default=30)
    poll_initial_s = models.FloatField(default=3)
    poll_max_interval_s = models.FloatField(default=60)
    poll_budget_s = models.FloatField(default=900)
    # Retries (durable RETRY_WAIT, full jitter, Retry-After first).
    retry_base_s = models.FloatField(default=1)
    retry_cap_s = models.FloatField(default=60)
    retry_after_cap_s = models.FloatField(default=300)
    max_attempts = models.PositiveIntegerField(default=5, help_text="Attempts on this channel before falling back.")
    reconcile_max_rounds = models.PositiveIntegerField(
        default=8, help_text="Reconciliation tries without an answer before an operator is asked to look."
    )
    audit_after_create = models.BooleanField(
        default=True, help_text="List the operation's jobs right after creating one, to catch duplicates early."
    )
    retry_budget_capacity = models.FloatField(default=100, help_text="Retry token bucket size.")
    retry_cost = models.FloatField(default=5)
    retry_timeout_cost = models.FloatField(default=10)
    retry_success_refund = models.FloatField(default=1)
    retry_refill_per_s = models.FloatField(default=0.5, help_text="Tokens regained per nominal second.")
    # Circuit breaker (resilience4j semantics).
    breaker_window = models.PositiveIntegerField(default=20)
    breaker_minimum_calls = models.PositiveIntegerField(default=10)
    breaker_failure_rate = models.FloatField(default=0.5)
    breaker_slow_call_s = models.FloatField(default=30)
    breaker_slow_call_rate = models.FloatField(default=1.0)
    breaker_open_wait_s = models.FloatField(default=30)
    breaker_half_open_calls = models.PositiveIntegerField(default=2)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["preference", "name"]

    def __str__(self) -> str:
        return self.name


class ChannelHealth(models.Model):
    """Runtime state of a channel shared by every process: breaker and retry budget."""

    class Breaker(models.TextChoices):
        CLOSED = "CLOSED"
        OPEN = "OPEN"
        HALF_OPEN = "HALF_OPEN"
        FORCED_OPEN = "FORCED_OPEN"
        DISABLED = "DISABLED"

    channel = models.OneToOneField(VendorChannel, on_delete=models.CASCADE, primary_key=True, related_name="health")
    breaker_state = models.CharField(max_length=16, choices=Breaker.choices, default=Breaker.CLOSED)
    breaker_version = models.PositiveIntegerField(default=0)
    opened_at = models.DateTimeField(null=True, blank=True)
    half_open_permits_used = models.PositiveIntegerField(default=0)
    half_open_successes = models.PositiveIntegerField(default=0)
    half_open_failures = models.PositiveIntegerField(default=0)
    window_started_call_id = models.BigIntegerField(default=0, help_text="Calls before this id are outside the window.")
    retry_tokens = models.FloatField(default=100)
    retry_tokens_at = models.DateTimeField(null=True, blank=True)
    ledger_cursor = models.CharField(max_length=100, blank=True, help_text="Where the last usage-ledger sync stopped.")
    ledger_sync_status = models.CharField(max_length=300, blank=True, help_text="How the last ledger sync ended.")
    ledger_synced_at = models.DateTimeField(null=True, blank=True)
    ledger_sync_due_at = models.DateTimeField(null=True, blank=True, help_text="An incomplete sync tries again then.")
    last_rate_limited_at = models.DateTimeField(null=True, blank=True)
    last_retry_after_s = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.channel_id}: {self.breaker_state}"


class BreakerTransition(models.Model):
    """History of a channel's breaker, for the console and for tests."""

    channel = models.ForeignKey(VendorChannel, on_delete=models.CASCADE, related_name="breaker_transitions")
    from_state = models.CharField(max_length=16)
    to_state = models.CharField(max_length=16)
    actor = models.CharField(max_length=150)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-at", "-id"]


class Task(models.Model):
    class Kind(models.TextChoices):
        TRANSCRIPTION = "transcription"
        CONVERSION = "conversion"

    class Priority(models.TextChoices):
        INTERACTIVE = "interactive"
        BATCH = "batch"

    class Phase(models.TextChoices):
        NONE = ""
        UPLOAD = "upload"
        CREATE = "create"
        POLL = "poll"
        FETCH = "fetch"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Indexes cost every insert and every move: the tenant's and lane's are the first columns of
    # the composite indexes below, the channel's and job's only index the tasks that have one.
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="tasks", db_index=False)
    file = models.ForeignKey(FileVersion, on_delete=models.PROTECT, related_name="tasks")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    target_format = models.CharField(max_length=16)
    params = models.JSONField(default=dict, blank=True)
    priority = models.CharField(max_length=16, choices=Priority.choices, default=Priority.BATCH)
    lane = models.ForeignKey(Lane, on_delete=models.PROTECT, related_name="tasks", null=True, blank=True, db_index=False)
    callback_url = models.URLField(blank=True)
    # The submission's Idempotency-Key and what its request was (a later use of the key with
    # another request is refused), kept 48 hours from acceptance, then forgotten (housekeeping).
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    idempotency_fingerprint = models.CharField(max_length=64, null=True, blank=True)

    # Lifecycle: written only by tasks.lifecycle.
    state = models.CharField(max_length=20, choices=State.choices, default=State.ACCEPTED)
    generation = models.PositiveIntegerField(default=0)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(help_text="Business deadline: waits, execution and retries.")
    queue_deadline_at = models.DateTimeField(null=True, blank=True)
    dispatch_deadline_at = models.DateTimeField(
        null=True, blank=True,
        help_text="What admission orders by: the earliest of the business and the first queue deadline; kept across retries.",
    )
    attempt_deadline_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    retries = models.PositiveIntegerField(default=0)
    deferred = models.BooleanField(default=False, help_text="Accepted while the lane was full (defer policy).")

    # Scheduling: when the next step is due, when a message for it went out, who holds it.
    phase = models.CharField(max_length=8, choices=Phase.choices, default=Phase.NONE, blank=True)
    due_at = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True, help_text="Slots granted, start sent.")
    lease_owner = models.CharField(max_length=100, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)

    # Vendor side of the current operation. The key is persisted before the first send.
    channel = models.ForeignKey(VendorChannel, on_delete=models.PROTECT, null=True, blank=True, related_name="tasks",
                                db_index=False)
    vendor_op_seq = models.PositiveIntegerField(default=0)
    vendor_client_ref = models.CharField(max_length=100, blank=True)
    vendor_idempotency_key = models.CharField(max_length=255, blank=True)
    upload_id = models.CharField(max_length=100, blank=True)
    upload_expires_at = models.DateTimeField(null=True, blank=True)
    vendor_job = models.ForeignKey(
        "VendorJob", on_delete=models.SET_NULL, null=True, blank=True, related_name="+", db_index=False
    )
    channel_attempts = models.PositiveIntegerField(default=0)
    abandoned_channels = models.JSONField(default=list, blank=True)
    reconcile_rounds = models.PositiveIntegerField(default=0, help_text="Reconciliation tries without an answer.")
    fetch_attempts = models.PositiveIntegerField(default=0, help_text="Failed downloads of the current result.")
    billing_audit_due_at = models.DateTimeField(
        null=True, blank=True,
        help_text="The vendor is asked again then for every job of the operation: a duplicate audit that could "
                  "not list them, or the follow-up after an ambiguous create (a create the vendor runs late).",
    )
    billing_audit_attempts = models.PositiveSmallIntegerField(default=0, help_text="Duplicate audits that failed in a row.")
    outage_since = models.DateTimeField(
        null=True, blank=True, help_text="Every channel failed this task's operation since then (not processed)."
    )
    waiting_reason = models.CharField(
        max_length=32, blank=True, help_text="Why a waiting task waits (RETRY_WAIT, RECONCILING); QUEUED is derived."
    )
    poll_interval_s = models.FloatField(default=0)
    poll_deadline_at = models.DateTimeField(null=True, blank=True)
    last_retry_after_s = models.FloatField(null=True, blank=True)

    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.CharField(max_length=500, blank=True)
    error_retryable = models.BooleanField(default=False)

    result_path = models.CharField(max_length=300, blank=True)
    result_sha256 = models.CharField(max_length=64, blank=True)
    result_size = models.BigIntegerField(null=True, blank=True)
    result_content_type = models.CharField(max_length=100, blank=True)
    estimated_units = models.PositiveIntegerField(null=True, blank=True)
    moves_note = models.TextField(
        null=True, blank=True, editable=False,
        help_text="SQLite: the history entries of the row's last recorded write, which a trigger copies into the "
                  "history as the write is made (tasks.lifecycle). Always empty on PostgreSQL.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="task_idempotency_key_per_tenant",
            )
        ]
        indexes = [
            models.Index(fields=["state", "due_at"]),
            models.Index(fields=["state", "lease_expires_at"], name="task_lease_held",
                         condition=Q(lease_expires_at__isnull=False)),
            # A lane's tasks by state: the lane counts read its live ones, never its history.
            models.Index(fields=["lane", "state", "dispatched_at", "created_at"], name="task_lane_state_oldest"),
            # A lane's tasks waiting for admission, in the orders admission reads them: the first
            # rows of a range, whatever the backlog. PostgreSQL does not take `dispatched_at IS NULL`
            # as an equality that keeps an index's order (SQLite does), so without these both read
            # and sorted every waiting task of the lane on every submission and admission pass.
            models.Index(fields=["lane", "state", "created_at"], name="task_lane_waiting_oldest",
                         condition=Q(dispatched_at__isnull=True)),
            models.Index(F("lane"), F("state"), ExpressionWrapper(Q(dispatch_deadline_at__isnull=True),
                                                                  output_field=models.BooleanField()),
                         F("dispatch_deadline_at"), F("queued_at"), F("created_at"), name="task_lane_waiting_heads",
                         condition=Q(dispatched_at__isnull=True)),
            # What a dispatcher's tick asks several times a second (is any waiting task past its
            # queue deadline, any deferred task waiting for room, any start unheard of): the first
            # rows of a range, not every task of a backlog read to answer no.
            models.Index(fields=["state", "queue_deadline_at"], name="task_waiting_deadline",
                         condition=Q(dispatched_at__isnull=True)),
            models.Index(fields=["state", "lane", "created_at"], name="task_deferred", condition=Q(deferred=True)),
            models.Index(fields=["state", "enqueued_at"], name="task_dispatched_enqueued",
                         condition=Q(dispatched_at__isnull=False)),
            models.Index(fields=["tenant", "state"]),
            models.Index(fields=["tenant", "-created_at"]),
            # The history's per-minute rollup reads the tasks started in its minutes.
            models.Index(fields=["started_at"], name="task_started", condition=Q(started_at__isnull=False)),
            # The results still kept, by tenant and age: the retention sweep's range.
            models.Index(fields=["tenant", "finished_at"], name="task_result_kept",
                         condition=models.Q(state="SUCCEEDED") & ~models.Q(result_path="")),
            models.Index(fields=["state", "deadline_at"]),
            models.Index(fields=["vendor_client_ref"]),
            # Indexes that hold only the tasks they are looked up by: none of them at intake.
            models.Index(fields=["channel"], name="task_channel", condition=Q(channel__isnull=False)),
            models.Index(fields=["vendor_job"], name="task_vendor_job", condition=Q(vendor_job__isnull=False)),
            models.Index(fields=["billing_audit_due_at"], name="task_billing_audit_due",
                         condition=Q(billing_audit_due_at__isnull=False)),
            # The keys kept, by age: the prune's range.
            models.Index(fields=["created_at"], name="task_idempotency_kept", condition=Q(idempotency_key__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"task {self.id} [{self.state}]"

    @property
    def is_terminal(self) -> bool:
        from tasks.states import TERMINAL_STATES

        return self.state in TERMINAL_STATES


class Attempt(models.Model):
    """One execution of a task, fenced by its generation."""

    class Outcome(models.TextChoices):
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        RETRY = "retry"
        RECONCILE = "reconcile"
        FAILED = "failed"
        FENCED = "fenced"
        CANCELLED = "cancelled"

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="attempt_rows")
    generation = models.PositiveIntegerField()
    owner = models.CharField(max_length=100, blank=True)
    host = models.CharField(max_length=100, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.RUNNING)
    error_class = models.CharField(max_length=32, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    channel = models.ForeignKey(VendorChannel, on_delete=models.SET_NULL, null=True, blank=True)
    vendor_job_id = models.CharField(max_length=100, blank=True)
    upload_ms = models.PositiveIntegerField(null=True, blank=True)
    note = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["generation"]
        constraints = [models.UniqueConstraint(fields=["task", "generation"], name="attempt_generation_unique")]

    def __str__(self) -> str:
        return f"attempt g{self.generation} of {self.task_id}"


class LaneTenantLoad(models.Model):
    """How many of one tenant's tasks are in each live stage of one lane. Kept exact by triggers on
    the task table (tasks/counters.py): every insert, update and delete of a task, whatever wrote
    it, moves its count; a gate or an admission pass reads these few rows instead of counting a
    backlog of thousands."""

    lane = models.CharField(max_length=32, help_text="The lane's name ('' for a task without one).")
    tenant = models.UUIDField()
    accepted = models.BigIntegerField(default=0, help_text="ACCEPTED (waiting for its pre-check or room).")
    queued = models.BigIntegerField(default=0, help_text="QUEUED, not yet dispatched (waiting for a slot).")
    dispatched = models.BigIntegerField(default=0, help_text="QUEUED and dispatched (holding a slot, about to start).")
    in_flight = models.BigIntegerField(default=0, help_text="RUNNING, RECONCILING or CANCEL_REQUESTED.")
    retry_wait = models.BigIntegerField(default=0, help_text="RETRY_WAIT.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["lane", "tenant"], name="lane_tenant_load_unique")]

    def __str__(self) -> str:
        return f"{self.lane}/{self.tenant}"


class TaskEvent(models.Model):
    """Append-only history of a task: every state change, and notable steps."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20, blank=True)
    generation = models.PositiveIntegerField()
    actor = models.CharField(max_length=100)
    reason = models.CharField(max_length=300)
    data = models.JSONField(default=dict, blank=True)
    at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.from_state}→{self.to_state} ({self.reason})"


class IdempotencyRecord(models.Model):
    """An intake Idempotency-Key as releases before migration 0025 kept it, beside the task's own
    copy. Since then the key and its request's fingerprint live on the task alone; these rows are
    no longer written, only read for a task a process of the previous release accepted while
    this one was rolled out (its fingerprint is here), and pruned with the keys. The table goes
    in a later release."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, db_index=False)  # the unique (tenant, key) leads with it
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, null=True, blank=True)
    locked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "key"], name="idempotency_record_unique")]
        indexes = [models.Index(fields=["created_at"], name="idempotency_record_created")]  # the prune's range


class VendorJob(models.Model):
    """A job that exists (or existed) at a vendor on behalf of a task."""

    # "lost": the vendor no longer knows the job (it forgot it); it was billed all the same.
    TERMINAL = ("completed", "failed", "canceled", "lost")

    channel = models.ForeignKey(VendorChannel, on_delete=models.PROTECT, related_name="jobs")
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="vendor_jobs")
    vendor_job_id = models.CharField(max_length=100)
    client_ref = models.CharField(max_length=100)
    idempotency_key = models.CharField(max_length=255, blank=True)
    status = models.CharField(max_length=16, default="queued")
    adopted = models.BooleanField(default=False, help_text="Found by reconciliation, not by our own answer.")
    duplicate_of = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True)
    billing_units = models.FloatField(null=True, blank=True)
    billing_unit = models.CharField(max_length=20, blank=True)
    amount_cents = models.IntegerField(null=True, blank=True)
    input_sha256 = models.CharField(max_length=64, blank=True)
    result_sha256 = models.CharField(max_length=64, blank=True, help_text="As the vendor declared it on completion.")
    result_size = models.BigIntegerField(null=True, blank=True)
    engine_version = models.CharField(max_length=64, blank=True, help_text="What processed it, where the vendor says (the local engine).")
    integrity_flag = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cleanup_sent_at = models.DateTimeField(null=True, blank=True)
    terminal_at = models.DateTimeField(null=True, blank=True, help_text="When we confirmed it terminal.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["channel", "vendor_job_id"], name="vendor_job_unique")
        ]
        indexes = [
            models.Index(fields=["channel", "terminal_at"]),
            # The jobs still live (the clean-up's probe, every dispatcher pass), not every job ever made.
            models.Index(fields=["task"], condition=models.Q(terminal_at__isnull=True), name="vendorjob_live"),
        ]

    def __str__(self) -> str:
        return f"{self.channel_id}:{self.vendor_job_id}"


class BudgetSlot(models.Model):
    """One unit of a channel budget held by a task: an upload in progress, or a vendor job."""

    class Kind(models.TextChoices):
        JOB = "job"
        UPLOAD = "upload"

    channel = models.ForeignKey(VendorChannel, on_delete=models.CASCADE, related_name="slots")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="slots")
    vendor_job = models.ForeignKey(VendorJob, on_delete=models.SET_NULL, null=True, blank=True)
    acquired_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)
    release_reason = models.CharField(max_length=100, blank=True)

    class Meta:
        # Open slots (not released, or released "in the future") by a range of this index, never
        # by reading the released ones every finished task leaves.
        indexes = [models.Index(fields=["channel", "released_at", "kind"], name="budgetslot_channel_open")]


class VendorCall(models.Model):
    """One HTTP call to a vendor, as the client saw it. Also the breaker's sliding window."""

    channel = models.ForeignKey(VendorChannel, on_delete=models.CASCADE, related_name="calls")
    task = models.ForeignKey(Task, on_delete=models.SET_NULL, null=True, blank=True, related_name="vendor_calls")
    generation = models.PositiveIntegerField(null=True, blank=True)
    operation = models.CharField(max_length=20)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error_class = models.CharField(max_length=64, blank=True)
    outcome = models.CharField(max_length=16, help_text="ok / not_processed / ambiguous / refused")
    decision = models.CharField(max_length=32, blank=True)
    duration_ms = models.PositiveIntegerField(default=0)
    bytes_sent = models.BigIntegerField(default=0)
    bytes_received = models.BigIntegerField(default=0)
    retry_after_s = models.FloatField(null=True, blank=True)
    counts_for_breaker = models.BooleanField(default=True)
    breaker_failure = models.BooleanField(default=False)
    slow = models.BooleanField(default=False)
    at = models.DateTimeField(default=timezone.now, db_index=True, help_text="When the call was made.")

    class Meta:
        indexes = [models.Index(fields=["channel", "-id"])]


class DuplicateIncident(models.Model):
    """A task was billed for more than one vendor job, whatever the channels or client_refs.

    One row per task. `kept_job_id` is the job whose result the task keeps (or its current one);
    `jobs` lists every other billed job with its channel, client_ref, amount and why it exists.
    """

    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="duplicate_incident")
    channel = models.ForeignKey(VendorChannel, on_delete=models.PROTECT, null=True, blank=True,
                                help_text="The kept job's channel.")
    client_ref = models.CharField(max_length=100, blank=True, help_text="The kept job's client_ref.")
    kept_job_id = models.CharField(max_length=100, blank=True)
    duplicate_job_ids = models.JSONField(default=list)
    duplicate_amount_cents = models.IntegerField(default=0)
    jobs = models.JSONField(default=list, help_text="[{channel, job_id, client_ref, amount_cents, cause}] of the extras.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"billed {len(self.duplicate_job_ids) + 1} times: task {self.task_id}"


class LedgerEntry(models.Model):
    """A copy of one entry of a vendor's usage ledger, for billing reconciliation."""

    channel = models.ForeignKey(VendorChannel, on_delete=models.CASCADE, related_name="ledger")
    entry_id = models.CharField(max_length=100)
    job_id = models.CharField(max_length=100)
    client_ref = models.CharField(max_length=100, blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    units = models.FloatField(default=0)
    unit = models.CharField(max_length=20, blank=True)
    amount_cents = models.IntegerField(default=0)
    billed_at = models.DateTimeField()
    synced_at = models.DateTimeField(auto_now=True)
    # The task the entry bills (found by its job, else by its client_ref) and when the ledger
    # check matched it: each check reads the entries not matched yet, and the entries of the
    # tasks they bill, never the whole ledger.
    task = models.ForeignKey("Task", on_delete=models.SET_NULL, null=True, blank=True, related_name="ledger_entries",
                             db_index=False)
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["channel", "entry_id"], name="ledger_entry_unique")]
        indexes = [models.Index(fields=["id"], condition=models.Q(checked_at__isnull=True), name="ledger_entry_unchecked"),
                   models.Index(fields=["task"], name="ledger_entry_task")]


class Quarantine(models.Model):
    """A file content held out of every lane until an operator releases or purges it."""

    class Reason(models.TextChoices):
        CORRUPT = "corrupt_file"
        TYPE_MISMATCH = "type_mismatch"
        UNSUPPORTED = "unsupported_type"
        EXECUTABLE = "executable"
        ZIP_BOMB = "zip_bomb"
        ENCRYPTED = "encrypted_document"
        OVER_LIMIT = "over_limit"
        PRECHECK_CRASHED = "precheck_crashed"
        PRECHECK_TIMEOUT = "precheck_timeout"
        POISON = "poison"
        TRAILING_PAYLOAD = "trailing_payload"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quarantine")
    file = models.ForeignKey(FileVersion, on_delete=models.CASCADE, related_name="quarantine_entries")
    sha256 = models.CharField(max_length=64)
    reason = models.CharField(max_length=32, choices=Reason.choices)
    detector_version = models.CharField(max_length=32)
    converter_version = models.CharField(max_length=64, blank=True)
    findings = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    released_by = models.CharField(max_length=150, blank=True)
    release_params = models.JSONField(default=dict, blank=True)
    purged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "sha256"]),
            # The entries still holding their content, by expiry: what the ten-minute sweeps read
            # (past retention, poison to re-evaluate), not every entry ever released or purged.
            models.Index(fields=["expires_at"], name="quarantine_held",
                         condition=models.Q(released_at__isnull=True, purged_at__isnull=True)),
        ]
        verbose_name_plural = "quarantine"

    def __str__(self) -> str:
        return f"quarantine {self.reason} ({self.sha256[:12]})"

    @property
    def is_open(self) -> bool:
        return self.released_at is None and self.purged_at is None


class DeadLetter(models.Model):
    """A task whose retries or deadline were spent on retryable errors. References only."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="dead_letters")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE)
    error_class = models.CharField(max_length=32)
    error_code = models.CharField(max_length=64)
    attempts = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolution = models.CharField(max_length=16, blank=True, help_text="replayed / discarded")
    resolved_by = models.CharField(max_length=150, blank=True)

    def __str__(self) -> str:
        return f"dead letter {self.task_id} ({self.error_code})"


class Notification(models.Model):
    """One terminal-state event to deliver to a tenant's callback URL; its own durable retry."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERING = "delivering"
        DELIVERED = "delivered"
        EXHAUSTED = "exhausted"
        # A newer terminal event of the same task replaced it before it was delivered.
        SUPERSEDED = "superseded"

    event_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="notifications")
    generation = models.PositiveIntegerField(default=0, help_text="The task's generation the event is about.")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE)
    url = models.URLField()
    event_type = models.CharField(max_length=32)
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=8)
    next_attempt_at = models.DateTimeField()
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=100, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["status", "next_attempt_at"])]
        constraints = [
            models.UniqueConstraint(fields=["task", "generation"], name="one_notification_per_task_generation")
        ]


class InboundVendorEvent(models.Model):
    """A signed vendor callback we accepted, kept to de-duplicate by event id."""

    channel = models.ForeignKey(VendorChannel, on_delete=models.CASCADE)
    event_id = models.CharField(max_length=100)
    job_id = models.CharField(max_length=100)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["channel", "event_id"], name="inbound_event_unique")]


class AuditEntry(models.Model):
    """Append-only record of an operator's action."""

    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32, blank=True)
    target_id = models.CharField(max_length=100, blank=True)
    filter = models.JSONField(default=dict, blank=True)
    done = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    detail = models.JSONField(default=dict, blank=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        permissions = [
            ("operate_tasks", "Retry, cancel and replay tasks"),
            ("manage_quarantine", "Release and purge quarantine, replay dead letters"),
            ("open_quarantined_file", "Open a quarantined file in a sandboxed download"),
            ("run_qa", "Run POC scenarios and change fake vendor faults"),
            ("configure", "Edit quotas, lanes, vendor channels and users"),
            ("operate_channels", "Force breakers, pause lanes, change concurrency"),
        ]

    def __str__(self) -> str:
        return f"{self.actor} {self.action} {self.target_type}:{self.target_id}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("audit entries are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("audit entries are append-only")


class HistoryMinute(models.Model):
    """One minute of what happened, per lane, per channel and overall: the console's history
    (kept 7 days, written by the dispatcher, tasks/services/history.py)."""

    class Scope(models.TextChoices):
        ALL = "all"
        LANE = "lane"
        CHANNEL = "channel"

    minute = models.DateTimeField()
    scope = models.CharField(max_length=8, choices=Scope.choices)
    key = models.CharField(max_length=64, blank=True)
    submitted = models.PositiveIntegerField(default=0)
    succeeded = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    retried = models.PositiveIntegerField(default=0)
    wait_p50_s = models.FloatField(null=True, blank=True, help_text="Queue wait of tasks that started this minute.")
    wait_p95_s = models.FloatField(null=True, blank=True)
    vendor_p50_ms = models.FloatField(null=True, blank=True, help_text="Duration of vendor calls made this minute.")
    vendor_p95_ms = models.FloatField(null=True, blank=True)
    errors = models.JSONField(default=dict, blank=True, help_text="Failures by error class.")
    computed_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["minute", "scope", "key"], name="history_minute_unique")]
        indexes = [models.Index(fields=["scope", "key", "minute"])]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.scope}:{self.key}"
