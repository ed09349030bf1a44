"""Prometheus metrics computed from the task table and the vendor call log at scrape time.

Counters are totals since the rows began; rates (submit success rate, poll success rate,
timeout rate, retry rate) are PromQL ratios of these series, e.g.
`rate(sluice_vendor_calls_total{operation="create_job",outcome="ok"}[5m]) / rate(sluice_vendor_calls_total{operation="create_job"}[5m])`.
"""

from __future__ import annotations

from django.db.models import Count, Q
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tasks.models import ChannelHealth, DuplicateIncident, Task, TaskEvent, VendorCall, VendorJob
from tasks.states import State

BREAKER_VALUES = {"CLOSED": 0, "HALF_OPEN": 1, "OPEN": 2, "FORCED_OPEN": 3, "DISABLED": -1}


class SluiceCollector:
    def collect(self):
        calls = CounterMetricFamily("sluice_vendor_calls", "Vendor calls by channel, operation and outcome",
                                    labels=["channel", "operation", "outcome"])
        for row in VendorCall.objects.values("channel_id", "operation", "outcome").annotate(n=Count("id")):
            calls.add_metric([row["channel_id"], row["operation"], row["outcome"]], row["n"])
        yield calls
        timeouts = CounterMetricFamily("sluice_vendor_timeouts", "Vendor calls that timed out",
                                       labels=["channel", "operation"])
        for row in (VendorCall.objects.filter(Q(error_class__contains="Timeout") | Q(error_class="UploadDeadlineExceeded"))
                    .values("channel_id", "operation").annotate(n=Count("id"))):
            timeouts.add_metric([row["channel_id"], row["operation"]], row["n"])
        yield timeouts
        events = TaskEvent.objects
        yield CounterMetricFamily("sluice_retries", "Retries scheduled", value=events.filter(to_state=State.RETRY_WAIT).count())
        yield CounterMetricFamily("sluice_reconciliations", "Moves to RECONCILING",
                                  value=events.filter(to_state=State.RECONCILING).count())
        yield CounterMetricFamily("sluice_fallbacks", "Tasks moved to another channel",
                                  value=events.filter(reason__startswith="fallback:").count())
        duplicates = CounterMetricFamily("sluice_duplicate_incidents", "Duplicate billing incidents", labels=["channel"])
        for row in DuplicateIncident.objects.values("channel_id").annotate(n=Count("id")):
            duplicates.add_metric([row["channel_id"] or ""], row["n"])
        yield duplicates
        breaker = GaugeMetricFamily("sluice_breaker_state", "0 closed, 1 half-open, 2 open, 3 forced open, -1 disabled",
                                    labels=["channel"])
        for health in ChannelHealth.objects.all():
            breaker.add_metric([health.channel_id], BREAKER_VALUES.get(health.breaker_state, 0))
        yield breaker
        inflight = GaugeMetricFamily("sluice_inflight_vendor_jobs", "Vendor jobs not yet confirmed terminal",
                                     labels=["channel"])
        for row in VendorJob.objects.filter(terminal_at__isnull=True).values("channel_id").annotate(n=Count("id")):
            inflight.add_metric([row["channel_id"]], row["n"])
        yield inflight
        states = GaugeMetricFamily("sluice_tasks", "Tasks by state", labels=["state"])
        counts = dict(Task.objects.values_list("state").annotate(n=Count("id")))
        for state in State.values:
            states.add_metric([state], counts.get(state, 0))
        yield states
