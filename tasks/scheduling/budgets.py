"""Channel budgets held across every process: concurrent uploads and in-flight vendor jobs, and
within them the channel's per-lane rows (VendorChannel.lane_slots: the local engine's converters).

A task reserves a job slot and an upload slot when it is dispatched. The upload slot is released
when its upload ends; the job reservation is released once a VendorJob row exists (which then
holds the budget until the job is confirmed terminal) or once it is proven no job was created.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import connections, router
from django.utils import timezone

from tasks.models import BudgetSlot, Task, VendorChannel, VendorJob
from tasks.rows import insert_rows, new_row, update
from tasks.states import State

JOB, UPLOAD = BudgetSlot.Kind.JOB, BudgetSlot.Kind.UPLOAD
# The only states a task's slots are reserved in (slots_reserve): a terminal move from any other
# found the task where no slot can be added to it, and trusts what its own statement read of them.
RESERVED_IN = frozenset({State.ACCEPTED, State.QUEUED})


def lane_rows(lane_slots: dict | None) -> dict[str, tuple[frozenset[str], int]]:
    """A channel's per-lane rows: key → (the lanes it bounds, how many jobs at once)."""
    return {key: (frozenset(part.strip() for part in key.split("+") if part.strip()), int(limit))
            for key, limit in (lane_slots or {}).items()}


@dataclass(frozen=True)
class ChannelUsage:
    jobs: int
    uploads: int
    jobs_by_lane: dict[str, int] = field(default_factory=dict)

    def free_by_row(self, channel: VendorChannel) -> dict[str, int]:
        """Free jobs of each of the channel's per-lane rows."""
        return {key: limit - sum(self.jobs_by_lane.get(lane, 0) for lane in lanes)
                for key, (lanes, limit) in lane_rows(channel.lane_slots).items()}

    def free_jobs(self, channel: VendorChannel) -> int:
        return channel.max_inflight_jobs - self.jobs

    def free_uploads(self, channel: VendorChannel) -> int:
        return channel.max_concurrent_uploads - self.uploads


def channels_usage(channels: list[VendorChannel]) -> dict[str, ChannelUsage]:
    """Every channel's usage in one statement, whatever the number of channels (the dispatcher
    looks at all of them on every admission pass): the open slots and the live jobs, counted
    per channel, kind and lane. The statement is built once per number of channels (a queryset
    compiled on every pass cost more than running it)."""
    names = [c.name for c in channels]
    jobs: dict[str, int] = dict.fromkeys(names, 0)
    uploads: dict[str, int] = dict.fromkeys(names, 0)
    by_lane: dict[str, dict[str, int]] = {name: {} for name in names}
    if not names:
        return {}
    alias = router.db_for_read(BudgetSlot)
    connection = connections[alias]
    now = BudgetSlot._meta.get_field("released_at").get_db_prep_value(timezone.now(), connection)
    with connection.cursor() as cursor:
        cursor.execute(_usage_sql(alias, len(names)), [*names, *names, now, *names])
        found = cursor.fetchall()
    for name, kind, lane, n in found:
        if kind == UPLOAD:
            uploads[name] += n
            continue
        jobs[name] += n
        by_lane[name][lane or ""] = by_lane[name].get(lane or "", 0) + n
    return {name: ChannelUsage(jobs=jobs[name], uploads=uploads[name], jobs_by_lane=by_lane[name]) for name in names}


@functools.lru_cache(maxsize=64)
def _usage_sql(alias: str, count: int) -> str:
    """channels_usage's statement for `count` channels: the open slots (a slot released "in the
    future" is still held: an aborted upload may still be draining) and the live jobs, by
    channel, kind and the task's lane."""
    quote = connections[alias].ops.quote_name

    def table(model) -> str:
        return quote(model._meta.db_table)

    def column(model, name: str) -> str:
        return quote(model._meta.get_field(name).column)

    names = ", ".join(["%s"] * count)
    task, task_id, lane = table(Task), column(Task, "id"), column(Task, "lane")
    released = column(BudgetSlot, "released_at")

    def open_slots(condition: str) -> str:
        # Two branches, one per condition, so that each reads its range of the (channel,
        # released_at) index: a slot table keeps every slot ever released, and an OR of the two
        # read all of a channel's slots on every admission (25 ms for 100,000 finished tasks).
        return (f"SELECT s.{column(BudgetSlot, 'channel')}, s.{column(BudgetSlot, 'kind')}, l.{lane}, COUNT(*)"
                f" FROM {table(BudgetSlot)} s LEFT JOIN {task} l ON l.{task_id} = s.{column(BudgetSlot, 'task')}"
                f" WHERE s.{column(BudgetSlot, 'channel')} IN ({names}) AND s.{released} {condition}"
                f" GROUP BY s.{column(BudgetSlot, 'channel')}, s.{column(BudgetSlot, 'kind')}, l.{lane}")

    return (
        f"{open_slots('IS NULL')} UNION ALL {open_slots('> %s')}"
        f" UNION ALL SELECT j.{column(VendorJob, 'channel')}, '{JOB.value}', l.{lane}, COUNT(*)"
        f" FROM {table(VendorJob)} j LEFT JOIN {task} l ON l.{task_id} = j.{column(VendorJob, 'task')}"
        f" WHERE j.{column(VendorJob, 'channel')} IN ({names}) AND j.{column(VendorJob, 'terminal_at')} IS NULL"
        f" GROUP BY j.{column(VendorJob, 'channel')}, l.{lane}")


def channel_usage(channel: VendorChannel) -> ChannelUsage:
    return channels_usage([channel])[channel.name]


def slots_reserve(task: Task, channel: VendorChannel) -> None:
    """Called by the dispatcher under its lock, after checking channel_usage(), in the transaction
    that holds the task's row in one of RESERVED_IN (its admission's move or update): whoever
    moves the task from another state knows no slot is being added meanwhile."""
    insert_rows([new_row(BudgetSlot, channel=channel, kind=JOB, task=task),
                 new_row(BudgetSlot, channel=channel, kind=UPLOAD, task=task)])


def slots_release(task_id, *kinds: str, reason: str, hold_s: float = 0.0) -> int:
    """Release the task's open slots now, or `hold_s` real seconds from now."""
    kinds = kinds or (JOB, UPLOAD)
    return update(BudgetSlot, {"released_at": timezone.now() + timedelta(seconds=hold_s), "release_reason": reason[:100]},
                  f"t.task_id = %s AND t.kind IN ({', '.join(['%s'] * len(kinds))}) AND t.released_at IS NULL",
                  [("task", task_id), *(("kind", kind) for kind in kinds)])  # every step's end releases some


def vendor_job_terminal(job: VendorJob, status: str) -> bool:
    """Confirm a vendor job ended: its budget slot is free from now on."""
    return bool(
        VendorJob.objects.filter(pk=job.pk, terminal_at__isnull=True).update(status=status, terminal_at=timezone.now())
    )
