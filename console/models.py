"""Console-side records: bulk operations (run in the background) and POC runs."""

from __future__ import annotations

from django.db import models


class BulkOperation(models.Model):
    """One action applied to every task matching a filter, in throttled background batches."""

    class Status(models.TextChoices):
        PREVIEWED = "previewed"
        RUNNING = "running"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"
        DONE = "done"
        FAILED = "failed"

    action = models.CharField(max_length=32)
    filter = models.JSONField(default=dict, help_text="The task list's query parameters.")
    params = models.JSONField(default=dict, blank=True)
    total = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    skipped_reasons = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PREVIEWED)
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"bulk {self.action} #{self.pk} ({self.status})"

    @property
    def progress_pct(self) -> int:
        return int(100 * (self.done + self.skipped) / self.total) if self.total else 100


class PocRun(models.Model):
    """A POC scenario started from the console (runs in the background, in its own processes)."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        PASSED = "passed"
        FAILED = "failed"
        ERROR = "error"

    scenario = models.CharField(max_length=64)
    seed = models.IntegerField(default=7)
    tasks = models.PositiveIntegerField(null=True, blank=True)
    time_scale = models.FloatField(null=True, blank=True)
    live = models.BooleanField(default=False, help_text="Drove the running system (its fake vendor's rules apply).")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    started_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    progress = models.CharField(max_length=300, blank=True)
    report = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.scenario} #{self.pk} ({self.status})"


class BenchmarkRow(models.Model):
    """Written by the benchmark's reference view: a bare Django view that inserts one row."""

    payload = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
