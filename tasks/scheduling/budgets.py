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
from typing import Any

from django.db import connections, router
from django.utils import timezone

from tasks.models import BudgetSlot, Task, VendorChannel, VendorJob
from tasks.rows import Write, json_rows, json_rows_sql, new_row
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
    """Every channel's usage in one statement, whatever the number of channels: the open slots
    and the live jobs, counted per channel, kind and lane. The statement is built once per number
    of channels (a queryset compiled on every pass cost more than running it). The dispatcher
    reads the usage with the channels themselves (`usage_sql`)."""
    names = [c.name for c in channels]
    if not names:
        return {}
    alias = router.db_for_read(BudgetSlot)
    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute(_usage_sql(alias, len(names)), [*names, *names, released_after(connection), *names])
        found = cursor.fetchall()
    counted: dict[str, list] = {name: [] for name in names}
    for name, kind, lane, n in found:
        counted[name].append((kind, lane, n))
    return {name: usage_of(rows) for name, rows in counted.items()}


def usage_of(counted: Any) -> ChannelUsage:
    """A channel's usage from its counts (kind, the task's lane, how many): `usage_sql`'s JSON
    column as read, or channels_usage's rows of the channel."""
    jobs = uploads = 0
    by_lane: dict[str, int] = {}
    for kind, lane, n in json_rows(counted):
        if kind == UPLOAD:
            uploads += n
            continue
        jobs += n
        by_lane[lane or ""] = by_lane.get(lane or "", 0) + n
    return ChannelUsage(jobs=jobs, uploads=uploads, jobs_by_lane=by_lane)


def released_after(connection):
    """The parameter of the usage statements: a slot released after now is still held."""
    return BudgetSlot._meta.get_field("released_at").get_db_prep_value(timezone.now(), connection)


def usage_sql(alias: str, channel: str) -> str:
    """A channel's usage as one JSON column of a statement that reads the channel (`channel`: the
    SQL of its name there), for `usage_of`: its open slots and live jobs counted by kind and the
    task's lane, read by the channel's ranges of the slot and job indexes. One placeholder, for
    `released_after`. The dispatcher reads its channels and their room so in one statement."""
    return _usage_json(alias).replace("{channel}", channel)


@functools.lru_cache(maxsize=8)
def _usage_json(alias: str) -> str:
    counted = _counted(alias, "= {channel}", by_channel=False)
    return f"SELECT {json_rows_sql(connections[alias].vendor, 'u.k, u.l, u.n')} FROM ({counted}) u"


@functools.lru_cache(maxsize=64)
def _usage_sql(alias: str, count: int) -> str:
    """channels_usage's statement for `count` channels."""
    return _counted(alias, f"IN ({', '.join(['%s'] * count)})", by_channel=True)


def _counted(alias: str, channels: str, *, by_channel: bool) -> str:
    """The open slots (a slot released "in the future" is still held: an aborted upload may still
    be draining) and the live jobs of the `channels` (SQL after the channel column: `IN (...)` or
    `= ...`), by kind and the task's lane (and by channel, `by_channel`), as columns k, l, n."""
    quote = connections[alias].ops.quote_name

    def table(model) -> str:
        return quote(model._meta.db_table)

    def column(model, name: str) -> str:
        return quote(model._meta.get_field(name).column)

    task, task_id, lane = table(Task), column(Task, "id"), column(Task, "lane")
    released = column(BudgetSlot, "released_at")
    slot_channel, job_channel = column(BudgetSlot, "channel"), column(VendorJob, "channel")

    def open_slots(condition: str) -> str:
        # Two branches, one per condition, so that each reads its range of the (channel,
        # released_at) index: a slot table keeps every slot ever released, and an OR of the two
        # read all of a channel's slots on every admission (25 ms for 100,000 finished tasks).
        head = f"s.{slot_channel}, " if by_channel else ""
        return (f"SELECT {head}s.{column(BudgetSlot, 'kind')} AS k, l.{lane} AS l, COUNT(*) AS n"
                f" FROM {table(BudgetSlot)} s LEFT JOIN {task} l ON l.{task_id} = s.{column(BudgetSlot, 'task')}"
                f" WHERE s.{slot_channel} {channels} AND s.{released} {condition}"
                f" GROUP BY {head}s.{column(BudgetSlot, 'kind')}, l.{lane}")

    head = f"j.{job_channel}, " if by_channel else ""
    return (
        f"{open_slots('IS NULL')} UNION ALL {open_slots('> %s')}"
        f" UNION ALL SELECT {head}'{JOB.value}', l.{lane}, COUNT(*)"
        f" FROM {table(VendorJob)} j LEFT JOIN {task} l ON l.{task_id} = j.{column(VendorJob, 'task')}"
        f" WHERE j.{job_channel} {channels} AND j.{column(VendorJob, 'terminal_at')} IS NULL"
        f" GROUP BY {head}l.{lane}")


def channel_usage(channel: VendorChannel) -> ChannelUsage:
    return channels_usage([channel])[channel.name]


def slots_reserve(task: Task, channel: VendorChannel) -> None:
    """Called by the dispatcher under its lock, after checking channel_usage(), in the transaction
    that holds the task's row in one of RESERVED_IN (its admission's move or update): whoever
    moves the task from another state knows no slot is being added meanwhile."""
    slots_reserved(task, channel).run()


def slots_reserved(task: Task, channel: VendorChannel) -> Write:
    """The task's two slots on `channel` (a job's, an upload's), as a write that goes with the move
    admitting it (`lifecycle.transition(writes=…)`), under the same conditions as slots_reserve."""
    return Write.insert([new_row(BudgetSlot, channel=channel, kind=JOB, task=task),
                         new_row(BudgetSlot, channel=channel, kind=UPLOAD, task=task)])


def slots_release(task_id, *kinds: str, reason: str, hold_s: float = 0.0) -> int:
    """Release the task's open slots now, or `hold_s` real seconds from now."""
    return slots_released(task_id, *kinds, reason=reason, hold_s=hold_s).run()


def slots_released(task_id, *kinds: str, reason: str, hold_s: float = 0.0, if_moved: bool = True) -> Write:
    """slots_release as a write that goes with a move of the task (`lifecycle.task_update(writes=…)`):
    with `if_moved`, only if the task moved; else whatever came of the move."""
    kinds = kinds or (JOB, UPLOAD)
    return Write.change(
        BudgetSlot, {"released_at": timezone.now() + timedelta(seconds=hold_s), "release_reason": reason[:100]},
        {"task": task_id, "kind": list(kinds), "released_at": None}, if_moved=if_moved)  # every step's end releases some


def vendor_job_terminal(job: VendorJob, status: str) -> bool:
    """Confirm a vendor job ended: its budget slot is free from now on."""
    return bool(
        VendorJob.objects.filter(pk=job.pk, terminal_at__isnull=True).update(status=status, terminal_at=timezone.now())
    )
