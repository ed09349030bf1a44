"""Queue messages are only triggers: they name a step, a task and the generation they were sent
for. A lost message is re-sent by the dispatcher; a duplicated one loses its compare-and-set."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.signing import TimestampSigner
from django.db import router, transaction
from django.utils import timezone
from django_q.brokers import Broker, get_broker
from django_q.conf import Conf
from django_q.signals import pre_enqueue
from django_q.signing import PickleSerializer
from django_q.tasks import async_task

from tasks import costs
from tasks.models import Lane, Task
from tasks.observability import log_event

_brokers: dict[tuple[int, str], Broker] = {}


def control_cluster() -> str:
    """The default django-q2 cluster: pre-checks, notifications, sweeps, bulk operations."""
    return settings.Q_CLUSTER["name"]


def _broker(cluster: str) -> Broker:
    key = (os.getpid(), cluster)
    if key not in _brokers:
        _brokers[key] = get_broker(cluster)
    return _brokers[key]


def send(func: str, *args: Any, cluster: str | None = None, name: str = "", timeout: int | None = None) -> bool:
    """Send a trigger. A broker that cannot be reached (Redis cut off, restarting) loses only the
    trigger: the row already says what is due and the dispatcher sends it again, so this returns
    False instead of failing the request or step that sent it. (The ORM broker's errors are the
    database's own and propagate with its transaction.)"""
    cluster = cluster or control_cluster()
    return _handed(cluster, lambda broker: _package(func, args, cluster=cluster, broker=broker, name=name, timeout=timeout),
                   operation=func, count=1)


def _handed(cluster: str, hand: Callable[[Broker], None], *, operation: str, count: int) -> bool:
    """`count` messages handed to the cluster's broker by `hand(broker)`; False when that broker
    failed a moment ago (no timeout waited out again for each send) or fails now."""
    for _ in range(count):
        costs.count("queue_messages")
    if time.monotonic() < _unreachable_until.get((os.getpid(), cluster), 0.0):
        return False
    try:
        hand(_broker(cluster))
    except _broker_errors() as exc:
        _unreachable_until[(os.getpid(), cluster)] = time.monotonic() + BROKER_RETRY_S
        log_event("queue_unreachable", logging.WARNING, operation=operation, reason=type(exc).__name__, count=count,
                  decision="the dispatcher sends them again")
        return False
    return True


def _package(func: str, args: tuple, *, cluster: str, broker: Any, name: str, timeout: int | None) -> None:
    """django-q2's message for `func(*args)`, signed and handed to `broker`: the package
    async_task builds, signed as it signs (SignedPackage.dumps), without what async_task adds
    around it for each message: a humanised name we replace, a Signer built again, and a log
    line formatted whatever its level (56 µs a message, about 20 without: a batch of 100
    submissions spent a tenth of its CPU there). Left to async_task where it does more: in sync mode (it runs
    the step) and when something listens to pre_enqueue."""
    options: dict[str, Any] = {"timeout": timeout} if timeout else {}
    if Conf.SYNC or pre_enqueue.has_listeners():
        async_task(func, *args, cluster=cluster, broker=broker, task_name=(name or func)[:100], **options)
        return
    task: dict[str, Any] = {"id": uuid.uuid4().hex, "name": (name or func)[:100], "func": func, "args": args,
                            "cluster": cluster, **options}
    if Conf.CACHED:
        task["cached"] = Conf.CACHED
    if Conf.ACK_FAILURES:
        task["ack_failure"] = Conf.ACK_FAILURES
    task["kwargs"] = {}
    task["started"] = timezone.now()
    broker.enqueue(_signer().sign_object(task, serializer=PickleSerializer, compress=Conf.COMPRESSED))


@functools.cache
def _signer() -> TimestampSigner:
    """The signer SignedPackage.dumps builds for each message (django-q2's key and salt)."""
    return TimestampSigner(key=Conf.SECRET_KEY, salt=Conf.PREFIX)


class _Collected:
    """What async_task hands a broker, kept to be written at once (Orm.enqueue_many)."""

    def __init__(self, list_key: str) -> None:
        self.list_key = list_key
        self.packages: list[str] = []

    def enqueue(self, package: str) -> int:
        self.packages.append(package)
        return len(self.packages)


# After a failed send, this process sends nothing to that broker for this long (real seconds).
BROKER_RETRY_S = 2.0
_unreachable_until: dict[tuple[int, str], float] = {}


def _broker_errors() -> tuple[type[BaseException], ...]:
    if "orm" in settings.Q_CLUSTER:
        return ()
    from redis.exceptions import RedisError

    return (RedisError, OSError)


def purge_lane_queue(cluster: str | None) -> None:
    """Drop every message waiting in a cluster's queue (the rows say what is due: the dispatcher
    sends what is still needed again). For benchmarks and operators clearing a flood."""
    _broker(cluster or control_cluster()).purge_queue()


def queue_backlog(cluster: str | None) -> int:
    """Messages waiting in a cluster's queue that no worker has taken yet."""
    return _broker(cluster or control_cluster()).queue_size() or 0


def send_step(step: str, task_id: Any, generation: int, *, lane: str | None = None) -> bool:
    """Ask a worker of `lane` (or the control cluster) to run `step` for the task at `generation`.

    The message carries the step's own django-q2 timeout: the lane's execution timeout now plus a
    grace. A step that outlives it (a vendor dribbling its answer past every read timeout) is
    killed and its worker replaced, after the watchdog has fenced the attempt."""
    func, args, name, timeout = _step_message(step, task_id, generation, lane)
    return send(func, *args, cluster=lane, name=name, timeout=timeout)


def _step_message(step: str, task_id: Any, generation: int, lane: str | None) -> tuple[str, tuple, str, int | None]:
    """A step's message: the function, its arguments, its name and its timeout."""
    return ("tasks.workers.run_step", (step, str(task_id), generation), f"{step} {task_id}",
            step_timeout_s(lane) if lane else None)


_lane_timeouts: dict[str, tuple[float, int]] = {}
LANE_TIMEOUT_CACHE_S = 5.0


def step_timeout_s(lane: str) -> int:
    """Real seconds a step of `lane` may run: the lane's execution timeout (as configured now,
    read at most every few seconds) plus the grace, never above the lane cluster's own bound."""
    cached = _lane_timeouts.get(lane)
    if cached and time.monotonic() - cached[0] < LANE_TIMEOUT_CACHE_S:
        return cached[1]
    execution = Lane.objects.filter(pk=lane).values_list("execution_timeout_s", flat=True).first()
    if execution is None:
        return settings.LANE_STEP_TIMEOUT_S.get(lane, settings.Q_CLUSTER["timeout"])
    return lane_read(lane, execution)


def lane_read(lane: str, execution_timeout_s: float) -> int:
    """Note a lane's execution timeout as a row just read says it (admission reads the lane before
    it sends starts, which step_timeout_s would otherwise read again); its steps' timeout."""
    scale = float(settings.TIME_SCALE)
    bound = settings.LANE_STEP_TIMEOUT_S.get(lane, settings.Q_CLUSTER["timeout"])
    grace = max(settings.STEP_GRACE_S * scale, settings.STEP_GRACE_FLOOR_S)
    timeout = min(int(math.ceil(execution_timeout_s * scale + grace)), bound)
    _lane_timeouts[lane] = (time.monotonic(), timeout)
    return timeout


def send_step_on_commit(step: str, task_id: Any, generation: int, *, lane: str | None = None) -> None:
    """Send once the surrounding transaction commits. With the ORM broker the message row is
    written in that same transaction instead (an outbox for free: both commit or neither does)."""
    if _written_with_the_transaction():
        send_step(step, task_id, generation, lane=lane)
        return
    transaction.on_commit(lambda: _send_or_leave_to_dispatcher(step, task_id, generation, lane=lane))


def _written_with_the_transaction(*, ahead: bool = False) -> bool:
    """Whether a message sent now is a row of the surrounding transaction (the ORM broker's), or
    (`ahead`) would be a row of a transaction about to begin."""
    from django_q.conf import Conf

    # (In django-q2's sync mode the step would run right here, inside the transaction: defer it.)
    return "orm" in settings.Q_CLUSTER and not Conf.SYNC and (ahead or transaction.get_connection().in_atomic_block)


def send_steps_on_commit(step: str, tasks: list[tuple[Any, int, str | None]]) -> None:
    """send_step_on_commit for each (task id, generation, lane), each lane's messages at once:
    with the ORM broker in one statement of the surrounding transaction, with Redis in one RPUSH
    after the commit (one round trip a lane, not one a task)."""
    if not tasks:
        return
    if _written_with_the_transaction():
        _send_many(step, tasks)
    elif transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: _send_many_or_leave_to_dispatcher(step, tasks))
    else:
        _send_many_or_leave_to_dispatcher(step, tasks)


def step_rows(step: str, tasks: list[tuple[Any, int, str | None]], *, ahead: bool = False) -> list[Any] | None:
    """The embedded broker's messages for each (task id, generation, lane), in `tasks`' order, as
    rows the caller writes in its transaction (as `send_steps_on_commit` would write them there,
    their doorbells rung at its commit), or (`ahead`) in the transaction it begins next; None
    where messages are not rows of the caller's transaction in the tasks' own database (Redis,
    django-q2's sync mode, another database): the caller sends them with `send_steps_on_commit`."""
    from django_q.models import OrmQ

    from tasks.brokers import Orm

    if not tasks or not _written_with_the_transaction(ahead=ahead) or router.db_for_write(OrmQ) != router.db_for_write(Task):
        return None
    clusters = {lane or control_cluster() for _, _, lane in tasks}
    if not all(isinstance(_broker(cluster), Orm) for cluster in clusters):
        return None
    by_cluster: dict[str, list[int]] = {}
    for n, (_, _, lane) in enumerate(tasks):
        by_cluster.setdefault(lane or control_cluster(), []).append(n)
    found: list[Any] = [None] * len(tasks)
    for cluster, indexes in by_cluster.items():
        broker = _broker(cluster)
        collected = _Collected(broker.list_key)
        for n in indexes:
            func, args, name, timeout = _step_message(step, *tasks[n])
            _package(func, args, cluster=cluster, broker=collected, name=name, timeout=timeout)
            if not ahead:
                costs.count("queue_messages")
        for n, row in zip(indexes, broker.message_rows(collected.packages, ring=not ahead), strict=True):
            found[n] = row
    return found


def messages_rung(messages: list[Any]) -> None:
    """In the transaction that writes them: the doorbells of the queues of messages made by
    `step_rows(ahead=True)` ring at its commit (and the messages are counted as sent: made
    ahead, they may have been dropped with a decision taken again)."""
    costs.count("queue_messages", len(messages))
    for key in dict.fromkeys(message.key for message in messages):
        _broker(key).ring()


def _send_many(step: str, tasks: list[tuple[Any, int, str | None]]) -> list[Any]:
    """Each lane's messages handed to its broker at once; the ids of the tasks whose messages could
    not be (their lane's broker unreachable). The ORM broker's errors propagate, as in `send`."""
    by_cluster: dict[str, list[tuple[Any, int, str | None]]] = {}
    for task_id, generation, lane in tasks:
        by_cluster.setdefault(lane or control_cluster(), []).append((task_id, generation, lane))
    unsent: list[Any] = []
    for cluster, sent in by_cluster.items():
        # Packaged before the broker is called (in django-q2's sync mode packaging runs the step:
        # what it raises is the step's, not the broker's).
        collected = _Collected(_broker(cluster).list_key)
        for task_id, generation, lane in sent:
            func, args, name, timeout = _step_message(step, task_id, generation, lane)
            _package(func, args, cluster=cluster, broker=collected, name=name, timeout=timeout)
        hand = functools.partial(_enqueue_many, packages=collected.packages)
        if not _handed(cluster, hand, operation=step, count=len(sent)):
            unsent += [task_id for task_id, _, _ in sent]
    return unsent


def _enqueue_many(broker: Broker, packages: list[str]) -> None:
    """Messages handed to a broker together: one statement (ORM, tasks.brokers.Orm), one RPUSH
    (Redis: a command of many values is atomic, all of them queued or none). None in django-q2's
    sync mode, which ran each step as it was packaged."""
    if not packages:
        return
    if hasattr(broker, "enqueue_many"):
        broker.enqueue_many(packages)
        return
    # Imported here: redis-py is loaded where Redis is the broker, not in every process (a few MB).
    from django_q.brokers.redis_broker import Redis

    if isinstance(broker, Redis):
        broker.connection.rpush(broker.list_key, *packages)
    else:
        for package in packages:
            broker.enqueue(package)


def _send_many_or_leave_to_dispatcher(step: str, tasks: list[tuple[Any, int, str | None]]) -> None:
    """_send_many after the commit; the triggers it could not send are marked unsent (one UPDATE),
    so a dispatcher that reaches the broker sends them on its next pass."""
    unsent = set(_send_many(step, tasks))
    if unsent:
        _mark_unsent([(task_id, generation) for task_id, generation, _ in tasks if task_id in unsent])


def _send_or_leave_to_dispatcher(step: str, task_id: Any, generation: int, *, lane: str | None) -> None:
    """A trigger this process could not send is marked unsent, so a dispatcher that reaches the
    broker sends it on its next pass instead of waiting out the lost-message delay."""
    if not send_step(step, task_id, generation, lane=lane):
        _mark_unsent([(task_id, generation)])


def _mark_unsent(tasks: list[tuple[Any, int]]) -> None:
    """These tasks' triggers were not sent (each at the generation it was for)."""
    from django.db import DatabaseError

    from tasks.models import Task

    by_generation: dict[int, list[Any]] = {}
    for task_id, generation in tasks:
        by_generation.setdefault(generation, []).append(task_id)
    try:
        for generation, ids in by_generation.items():  # one UPDATE for a batch's pre-checks
            Task.objects.filter(pk__in=ids, generation=generation).update(enqueued_at=None)
    except DatabaseError:
        pass  # committed already: the dispatcher resends them after the lost-message delay
