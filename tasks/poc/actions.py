"""Things a scenario does during its run (each takes the RunContext)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django_q.brokers import get_broker

from tasks.models import ChannelHealth, Task, VendorChannel
from tasks.queueing import control_cluster, send_step
from tasks.states import State


def all_submitted(ctx) -> bool:
    return len(ctx.accepted) + len(ctx.rejected) >= ctx.tasks and bool(ctx.accepted)


def lose_every_queued_message_then_start_workers(ctx) -> None:
    """The broker loses every message sent so far (a Redis restart, a purged queue)."""
    purged = 0
    for cluster in (control_cluster(), *settings.LANES):
        broker = get_broker(cluster)
        purged += broker.queue_size() or 0
        broker.purge_queue()
    ctx.notes["messages_lost"] = purged
    from tasks.poc.runner import start_workers

    start_workers(ctx.stack, ctx.scenario)
    ctx.notes["workers_started_at_s"] = round(ctx.elapsed_nominal(), 2)


def duplicate_messages(ctx) -> None:
    """The broker delivers some messages twice: send extra copies of each task's next message."""
    seen = ctx.notes.setdefault("_duplicated", set())
    ids = [a.id for a in ctx.accepted]
    for task in Task.objects.filter(pk__in=ids, state__in=(State.ACCEPTED, State.QUEUED)).values("pk", "state", "generation", "lane_id", "dispatched_at"):
        key = (str(task["pk"]), task["state"], task["generation"])
        if key in seen:
            continue
        if task["state"] == State.ACCEPTED:
            send_step("precheck", task["pk"], task["generation"], lane=task["lane_id"])
            send_step("precheck", task["pk"], task["generation"], lane=task["lane_id"])
        elif task["dispatched_at"] is not None:
            send_step("start", task["pk"], task["generation"], lane=task["lane_id"])
            send_step("start", task["pk"], task["generation"], lane=task["lane_id"])
        else:
            continue
        seen.add(key)
        ctx.notes["duplicate_messages_sent"] = ctx.notes.get("duplicate_messages_sent", 0) + 2


def workers_running(ctx) -> bool:
    return "workers_started_at_s" in ctx.notes


def set_channel(name: str, **values: Any) -> Callable:
    def act(ctx) -> None:
        VendorChannel.objects.filter(pk=name).update(**values)

    return act


def vendor_recovers(rule_id: str, *, channel: str = "primary", wait_nominal_s: float = 300) -> Callable:
    """Remove the outage rule, then wait until the channel's breaker has closed again."""

    def act(ctx) -> None:
        ctx.control.delete_rule(rule_id)
        ctx.notes["recovered_at_s"] = round(ctx.elapsed_nominal(), 2)
        deadline = time.monotonic() + ctx.scaled(wait_nominal_s)
        while time.monotonic() < deadline:
            if ChannelHealth.objects.get(pk=channel).breaker_state == ChannelHealth.Breaker.CLOSED:
                ctx.notes["breaker_closed_at_s"] = round(ctx.elapsed_nominal(), 2)
                return
            time.sleep(0.05)

    return act


def _worker_pid(lease_owner: str) -> int | None:
    try:
        return int(lease_owner.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def kill_worker_during(phase: str, *, note: str) -> Callable:
    """SIGKILL the worker process that holds a task's lease in the given phase (upload, poll)."""

    def act(ctx) -> None:
        ids = [a.id for a in ctx.accepted]
        for task in Task.objects.filter(pk__in=ids, state=State.RUNNING, phase=phase).exclude(lease_owner=""):
            pid = _worker_pid(task.lease_owner)
            if pid and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                ctx.notes[note] = {"task": str(task.pk), "pid": pid}
                return
        raise RuntimeError(f"no worker was holding a task in phase {phase}")

    return act


def a_task_in_phase(phase: str) -> Callable:
    def ready(ctx) -> bool:
        ids = [a.id for a in ctx.accepted]
        return Task.objects.filter(pk__in=ids, state=State.RUNNING, phase=phase).exclude(lease_owner="").exists()

    return ready


def cancel_running(*, content: str, phase: str = Task.Phase.POLL, limit: int | None = None) -> Callable:
    """Business users cancel their tasks of this content while they are in `phase` (at most
    `limit` of them by this action)."""

    def act(ctx) -> None:
        done = ctx.notes.setdefault(f"_cancelled_in_{phase}_{content}", set())
        targets = [a.id for a in ctx.accepted if a.spec.content == content and a.id not in ctx.cancels]
        for task in Task.objects.filter(pk__in=targets, state=State.RUNNING, phase=phase):
            if limit is not None and len(done) >= limit:
                return
            done.add(str(task.pk))
            ctx.cancel(str(task.pk))

    return act


def cancel_while_downloading(*, content: str, endpoint: str = "GET /v1/jobs/*/result") -> Callable:
    """Business users cancel their tasks of this content while the vendor is sending them their
    result (the vendor's own list of requests in flight says so): the download ends after the
    cancel, so its result must be refused. The tasks are noted in `cancelled_mid_download`."""

    def act(ctx) -> None:
        downloading = {r["job_id"] for r in ctx.control.in_flight() if r["endpoint"] == endpoint and r["job_id"]}
        if not downloading:
            return
        noted = ctx.notes.setdefault("cancelled_mid_download", [])
        targets = [a.id for a in ctx.accepted if a.spec.content == content and a.id not in ctx.cancels]
        for task in Task.objects.filter(pk__in=targets, state=State.RUNNING, vendor_job__vendor_job_id__in=downloading):
            noted.append(str(task.pk))
            ctx.cancel(str(task.pk))

    return act


def cancel_while_fetching(*, within_nominal_s: float = 5.0) -> Callable:
    """Once a task's worker starts downloading its finished result, cancel it at a seeded moment
    within the next few seconds: the download takes a random time too, so the cancel and the
    success commit race and either may win."""
    import random
    import threading

    def act(ctx) -> None:
        rng = ctx.notes.setdefault("_cancel_rng", random.Random(ctx.seed))
        planned = ctx.notes.setdefault("_cancel_planned", set())
        ids = [a.id for a in ctx.accepted if a.id not in planned]
        for task_id in Task.objects.filter(pk__in=ids, state=State.RUNNING, phase=Task.Phase.FETCH).values_list("pk", flat=True):
            planned.add(str(task_id))
            timer = threading.Timer(ctx.scaled(rng.uniform(0, within_nominal_s)), ctx.cancel, args=(str(task_id),))
            timer.daemon = True
            timer.start()

    return act


def vendor_forgets(ctx) -> None:
    """The vendor loses its memory of every upload, job and key (its ledger stays)."""
    forgotten = ctx.control.amnesia()["forgotten"]
    ctx.notes.setdefault("vendor_forgot", []).append({"at_s": round(ctx.elapsed_nominal(), 1), **forgotten})


def jobs_in_flight(count: int) -> Callable:
    """At least `count` of the run's tasks are waiting on a vendor job."""

    def ready(ctx) -> bool:
        ids = [a.id for a in ctx.accepted]
        return Task.objects.filter(pk__in=ids, state=State.RUNNING, phase=Task.Phase.POLL).count() >= count

    return ready


def a_task_fenced(ctx) -> bool:
    from tasks.models import TaskEvent

    ids = [a.id for a in ctx.accepted]
    return TaskEvent.objects.filter(task_id__in=ids, actor="watchdog").exists()


def note_fence(ctx) -> None:
    from tasks.models import TaskEvent

    ids = [a.id for a in ctx.accepted]
    event = TaskEvent.objects.filter(task_id__in=ids, actor="watchdog").order_by("at").first()
    ctx.notes["fenced"] = {"task": str(event.task_id), **(event.data.get("watchdog") or {})}
