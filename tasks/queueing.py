"""Queue messages are only triggers: they name a step, a task and the generation they were sent
for. A lost message is re-sent by the dispatcher; a duplicated one loses its compare-and-set."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.db import transaction
from django_q.brokers import Broker, get_broker
from django_q.tasks import async_task

_brokers: dict[tuple[int, str], Broker] = {}


def control_cluster() -> str:
    """The default django-q2 cluster: pre-checks, notifications, sweeps, bulk operations."""
    return settings.Q_CLUSTER["name"]


def _broker(cluster: str) -> Broker:
    key = (os.getpid(), cluster)
    if key not in _brokers:
        _brokers[key] = get_broker(cluster)
    return _brokers[key]


def send(func: str, *args: Any, cluster: str | None = None, name: str = "") -> None:
    cluster = cluster or control_cluster()
    async_task(func, *args, cluster=cluster, broker=_broker(cluster), task_name=(name or func)[:100])


def queue_backlog(cluster: str | None) -> int:
    """Messages waiting in a cluster's queue that no worker has taken yet."""
    return _broker(cluster or control_cluster()).queue_size() or 0


def send_step(step: str, task_id: Any, generation: int, *, lane: str | None = None) -> None:
    """Ask a worker of `lane` (or the control cluster) to run `step` for the task at `generation`."""
    send("tasks.workers.run_step", step, str(task_id), generation, cluster=lane, name=f"{step} {task_id}")


def send_step_on_commit(step: str, task_id: Any, generation: int, *, lane: str | None = None) -> None:
    """Send once the surrounding transaction commits. With the ORM broker the message row is
    written in that same transaction instead (an outbox for free: both commit or neither does)."""
    from django_q.conf import Conf

    # (In django-q2's sync mode the step would run right here, inside the transaction: defer it.)
    if "orm" in settings.Q_CLUSTER and not Conf.SYNC and transaction.get_connection().in_atomic_block:
        send_step(step, task_id, generation, lane=lane)
        return
    transaction.on_commit(lambda: send_step(step, task_id, generation, lane=lane))
