"""Evidence of a run: Sluice's database, the vendor's journal, ledger and invariants, the logs."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from tasks.models import (
    Attempt,
    BudgetSlot,
    DeadLetter,
    DuplicateIncident,
    Notification,
    Quarantine,
    Task,
    TaskEvent,
    VendorChannel,
    VendorJob,
)
from tasks.poc.context import RunContext
from tasks.poc.dialects import native_endpoint
from tasks.states import State


@dataclass
class Evidence:
    ctx: RunContext
    tasks: dict[str, Task]
    events: dict[str, list[TaskEvent]]
    attempts: dict[str, list[Attempt]]
    vendor_jobs: list[VendorJob]
    incidents: list[DuplicateIncident]
    channels: dict[str, VendorChannel]
    open_slots: int
    live_vendor_jobs: int
    journal: list[dict[str, Any]]
    invariants: dict[str, Any]
    ledger: list[dict[str, Any]] = field(default_factory=list)
    log_files: list[Path] = field(default_factory=list)

    @classmethod
    def collect(cls, ctx: RunContext) -> Evidence:
        ids = [a.id for a in ctx.accepted]
        tasks = {str(t.pk): t for t in Task.objects.filter(pk__in=ids).select_related("file", "lane")}
        events: dict[str, list[TaskEvent]] = defaultdict(list)
        for event in TaskEvent.objects.filter(task_id__in=ids).order_by("at", "id"):
            events[str(event.task_id)].append(event)
        attempts: dict[str, list[Attempt]] = defaultdict(list)
        for attempt in Attempt.objects.filter(task_id__in=ids).order_by("generation"):
            attempts[str(attempt.task_id)].append(attempt)
        logs: list[Path] = []
        if ctx.stack is not None:
            logs = sorted(ctx.stack.log_dir.glob("*.log"))
        elif settings.LOG_FILE:
            logs = [Path(settings.LOG_FILE)]
        return cls(
            ctx=ctx,
            tasks=tasks,
            events=events,
            attempts=attempts,
            vendor_jobs=list(VendorJob.objects.filter(task_id__in=ids)),
            incidents=list(DuplicateIncident.objects.all()),
            channels={c.name: c for c in VendorChannel.objects.all()},
            open_slots=BudgetSlot.objects.filter(released_at__isnull=True, task_id__in=ids).count(),
            live_vendor_jobs=VendorJob.objects.filter(terminal_at__isnull=True, task_id__in=ids).count(),
            journal=_normalized(ctx, ctx.control.journal()),
            invariants=ctx.control.invariants(),
            ledger=ctx.control.ledger(),
            log_files=logs,
        )

    # --- derived facts -------------------------------------------------------------------------------
    def states(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for task in self.tasks.values():
            counts[task.state] += 1
        return dict(counts)

    def queue_waits_s(self, *, lane: str | None = None) -> list[float]:
        """Nominal seconds from entering the queue to the first attempt starting, per task."""
        waits = []
        for task_id, events in self.events.items():
            task = self.tasks.get(task_id)
            if lane and (task is None or task.lane_id != lane):
                continue
            queued = next((e.at for e in events if e.to_state == State.QUEUED), None)
            running = next((e.at for e in events if e.to_state == State.RUNNING and queued and e.at >= queued), None)
            if queued and running:
                waits.append((running - queued).total_seconds() / self.ctx.time_scale)
        return waits

    def p95(self, values: list[float]) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))], 3)

    def count_events(self, *, to_state: str | None = None, reason_contains: str | None = None) -> int:
        total = 0
        for events in self.events.values():
            for event in events:
                if to_state and event.to_state != to_state:
                    continue
                if reason_contains and reason_contains not in event.reason:
                    continue
                total += 1
        return total

    def journal_where(self, *, endpoint: str | None = None, status: int | None = None, outcome_prefix: str | None = None,
                      channel: str | None = None, task_id: str | None = None) -> list[dict[str, Any]]:
        return [
            e for e in self.journal
            if (endpoint is None or e["endpoint"] == endpoint)
            and (status is None or e["status"] == status)
            and (outcome_prefix is None or (e["outcome"] or "").startswith(outcome_prefix))
            and (channel is None or e["channel"] == channel)
            and (task_id is None or e["task_id"] == task_id)
        ]

    def task_of_digest(self, sha256: str | None) -> str | None:
        return next((a.id for a in self.ctx.accepted if sha256 and a.sha256 == sha256), None)

    def billed_by_task(self) -> dict[str, set[tuple[str, str]]]:
        """The vendor's own ledger, every channel, grouped by the task each entry was billed for
        (our client_refs are `<task id>-<operation>`; where a vendor has none, the input's digest
        ties the job to its task): the truth of what was paid, per task."""
        ids = set(self.tasks)
        # A dialect without client references (AssemblyAI) is attributed by the input's digest:
        # every file a run submits is unique.
        by_digest = {a.sha256: a.id for a in self.ctx.accepted}
        billed: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for entry in self.ledger:
            task_id = (entry.get("client_ref") or "").rsplit("-", 1)[0]
            if task_id not in ids:
                task_id = by_digest.get(entry.get("input_sha256") or "")
            if task_id in ids:
                billed[task_id].add((entry["channel"], entry["job_id"]))
        return billed

    def stored_texts(self) -> list[str]:
        """Everything Sluice stored as free text: errors, history, dead letters, quarantine findings."""
        ids = list(self.tasks)
        texts: list[str] = []
        for task in self.tasks.values():
            texts += [task.error_message, task.error_code]
        for events in self.events.values():
            texts += [e.reason + " " + repr(e.data) for e in events]
        texts += [repr(d.__dict__) for d in DeadLetter.objects.filter(task_id__in=ids)]
        texts += [repr(q.findings) + q.reason for q in Quarantine.objects.all()]
        texts += [repr(n.payload) + n.last_error for n in Notification.objects.filter(task_id__in=ids)]
        texts += [a.note + a.error_code for attempts in self.attempts.values() for a in attempts]
        return texts

    def dispatcher_pauses_s(self) -> list[float]:
        """The dispatcher's pauses during the run (real seconds), as it logged them: every wait of
        the work it moves (a retry falling due, admission) that was longer than its loop allows."""
        pauses = []
        for path in self.log_files:
            try:
                with open(path, errors="replace") as lines:
                    found = [line for line in lines if '"dispatcher_paused"' in line]
            except OSError:
                continue  # a log file that is not there (a live system's, elsewhere) has no pauses to read
            for line in found:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == "dispatcher_paused" and entry.get("ts", 0) >= self.ctx.started_at:
                    pauses.append(entry.get("duration_ms", 0) / 1000)
        return pauses

    def metrics(self) -> dict[str, Any]:
        waits = self.queue_waits_s()
        pauses = self.dispatcher_pauses_s()
        return {
            "states": self.states(),
            "vendor_jobs_billed": self.invariants.get("billed_jobs", 0),
            "vendor_requests": len(self.journal),
            "retries": self.count_events(to_state=State.RETRY_WAIT),
            "reconciliations": self.count_events(to_state=State.RECONCILING),
            "duplicates_detected": sum(len(i.duplicate_job_ids) for i in self.incidents),
            "billed_jobs_per_task_max": max((len(j) for j in self.billed_by_task().values()), default=0),
            "tasks_billed_more_than_once": sum(1 for j in self.billed_by_task().values() if len(j) > 1),
            "p95_queue_wait_s": self.p95(waits),
            "median_queue_wait_s": round(statistics.median(waits), 3) if waits else 0.0,
            "rejected_submissions": len(self.ctx.rejected),
            "p95_queue_wait_s_by_lane": {
                lane: self.p95(self.queue_waits_s(lane=lane))
                for lane in sorted({t.lane_id for t in self.tasks.values() if t.lane_id})
            },
            # Real seconds: a pause reads the same whatever the time scale (a loaded CI machine's).
            "dispatcher_pauses": len(pauses),
            "dispatcher_longest_pause_s": round(max(pauses, default=0.0), 3),
        }


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _normalized(ctx: RunContext, journal: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Journal entries as the native dialect names them, each tied to the run's task it is about:
    by our client_ref where the dialect has one, else by the input's digest the vendor knows."""
    by_digest = {a.sha256: a.id for a in ctx.accepted}
    ids = {a.id for a in ctx.accepted}
    for entry in journal:
        entry["wire_endpoint"] = entry["endpoint"]
        entry["endpoint"] = native_endpoint(entry["endpoint"])
        task_id = (entry.get("client_ref") or "").rsplit("-", 1)[0]
        if task_id not in ids:
            task_id = by_digest.get(entry.get("input_sha256") or "")
        entry["task_id"] = task_id
        if not entry.get("client_ref") and task_id:
            # Without references of ours, one task is one operation as far as the journal can tell.
            entry["client_ref"] = f"{task_id}-*"
    return journal
