"""django-q2's ORM broker (the embedded default), with a cheaper acknowledgement and send.

django-q2 deletes an acknowledged message through Django's deletion collector, which opens a
transaction of its own around the one DELETE (a BEGIN on SQLite, two round trips more on
PostgreSQL) for every message. A message row has nothing that cascades or listens: one DELETE
statement, atomic by itself, does the same. A message is written with an INSERT built once
(`tasks.rows.insert_rows`), not through the query compiler: a submission writes one. And the
pusher's poll (ten times a second in every cluster) and its claim of a message are read and
written the same way, as django-q2 reads and writes them.

A lane's messages are triggers of steps and nothing more: the task table says which step is
due, a step that finds nothing to do does nothing, and the dispatcher sends again a step it has
not heard of (tasks/services/dispatch.py, `presumed_lost`). So a lane's pusher takes its messages
by deleting them, in the statement that finds them, and their acknowledgement writes nothing: a
message taken by a cluster that dies before running it is sent again by the dispatcher, within
seconds, where the lock's claim would have had django-q2 deliver it again only after the lane's
step timeout. The control cluster's messages (sweeps, notifications, bulk operations) keep the
claim and the acknowledgement.

On SQLite every process is on one machine, and a key's pusher rests between messages instead
of asking the database ten times a second: a message's sender rings the key's doorbell (a byte
appended to a file beside the database, after its transaction commits) and a pusher whose last
poll found nothing polls again only when the doorbell rang since, or QUIET_POLL_S after that
poll (a bound for a ring that never came: a sender killed between its commit and its ring). A
resting pusher costs a `stat` where it cost a statement (the control cluster's an UPDATE that
queued for SQLite's one writer) ten times a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from datetime import datetime, timedelta
from functools import cached_property
from time import monotonic, sleep
from typing import Any

from django.conf import settings
from django.db import connections, router, transaction
from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.models import OrmQ

from tasks.rows import insert_rows, new_row, update_sql

logger = logging.getLogger(__name__)

QUIET_POLL_S = 1.0  # a resting pusher's longest pause between polls (real seconds, as django-q2's POLL)
ROLLOVER_BYTES = 4096  # a doorbell's file is emptied when it reaches this size


class Doorbell:
    """A key's doorbell on SQLite (this module's docstring): `ring` after a message commits;
    `rang` says whether it rang since the pusher's last look, which `looked` records."""

    _complained = False

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: Any = object()  # nothing seen yet: the first look always finds a ring

    @classmethod
    def of(cls, key: str) -> Doorbell | None:
        """The doorbell of `key`'s messages, or None where pushers poll (not SQLite, or a
        database in memory that no other process shares)."""
        connection = connections[Conf.ORM]
        if connection.vendor != "sqlite" or connection.is_in_memory_db():
            return None
        safe = re.sub(r"[^A-Za-z0-9_-]", "", key)
        if safe != key or not safe:
            safe = f"{safe[:40]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        return cls(f"{connection.settings_dict['NAME']}.doorbell-{safe}")

    def ring(self) -> None:
        # Writable by whoever may write the database (the umask decides, as for SQLite's files).
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                os.write(fd, b".")
                if os.fstat(fd).st_size >= ROLLOVER_BYTES:
                    os.ftruncate(fd, 0)  # a change a pusher sees like any other ring
            finally:
                os.close(fd)
        except OSError as error:
            # The message is taken all the same, within QUIET_POLL_S: said once per process.
            if not Doorbell._complained:
                Doorbell._complained = True
                logger.warning("a doorbell cannot be rung (%s): resting pushers poll every %s s",
                               type(error).__name__, QUIET_POLL_S)

    def _state(self) -> tuple[int, int, int] | None:
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        return found.st_ino, found.st_size, found.st_mtime_ns

    def rang(self) -> bool:
        return self._state() != self._seen

    def looked(self) -> None:
        self._seen = self._state()


class Orm(ORM):
    _rested_since: float | None = None  # when this pusher's last poll found nothing

    def delete(self, task_id: Any) -> None:
        if self._takes_by_deleting():  # taken, so gone already
            return
        rows = self.get_connection().filter(pk=task_id)
        rows._raw_delete(rows.db)

    def enqueue(self, task: Any) -> Any:
        self.get_connection()  # what django-q2's does first (old connections closed outside a transaction)
        sent = insert_rows([new_row(OrmQ, key=self._key(), payload=task, lock=timezone.now())],
                           return_pk=True, using=Conf.ORM)
        self.ring()
        return sent

    def enqueue_many(self, packages: list[str]) -> None:
        """Messages written in one statement (a batch submission's pre-checks)."""
        self.get_connection()  # (as enqueue)
        insert_rows(self.message_rows(packages, ring=False), using=Conf.ORM)
        self.ring()  # once they are written (outside a transaction the ring is at once)

    def message_rows(self, packages: list[str], *, ring: bool = True) -> list[OrmQ]:
        """The messages as rows (unsaved), for a caller that writes them in its transaction (a new
        task's INSERT carries its pre-check's message on SQLite); the doorbell rings at its commit
        (not `ring`: rows made before the transaction begins, rung by `ring` in it). Nothing
        here touches the database."""
        now = timezone.now()
        if ring:
            self.ring()
        return [new_row(OrmQ, key=self._key(), payload=package, lock=now) for package in packages]

    def _key(self) -> str:
        return self.list_key or Conf.CLUSTER_NAME

    @cached_property
    def doorbell(self) -> Doorbell | None:
        return Doorbell.of(self._key())

    def ring(self) -> None:
        """Ring the key's doorbell once the message is there for the pushers: now, or when the
        caller's transaction commits (a message rolled back with it rings nothing)."""
        if self.doorbell is not None:
            transaction.on_commit(self.doorbell.ring, using=Conf.ORM)

    def dequeue(self) -> list[tuple[Any, str]] | None:
        """django-q2's: up to BULK messages due, each claimed by moving its lock forward only if
        no other cluster moved it first (here in one statement, where django-q2 reads them and
        then claims each); None (after a pause of POLL) when none is due."""
        if not self._statements_of_its_own():
            return super().dequeue()
        self.get_connection()  # old connections closed outside a transaction, as django-q2's does
        bell = self.doorbell
        if bell is not None and self._rested_since is not None:
            if not bell.rang() and monotonic() < self._rested_since + QUIET_POLL_S:
                sleep(Conf.POLL)
                return None
        if bell is not None:
            bell.looked()  # before the poll: a message sent during it rings again after this look
        now = timezone.now()
        if self._takes_by_deleting():
            claimed = _taken(Conf.ORM, self.list_key, now)
        else:
            claimed = _claimed(Conf.ORM, self.list_key, now, now + timedelta(seconds=Conf.RETRY))
        if not claimed:
            self._rested_since = monotonic()
            sleep(Conf.POLL)
            return None
        self._rested_since = None  # more may be due than one poll takes (BULK): poll again at once
        return claimed

    def _takes_by_deleting(self) -> bool:
        """A lane's cluster: its messages are triggers of steps (this module's docstring), taken
        by deleting them (where django-q2's own claim runs instead, its acknowledgement deletes)."""
        return self.list_key in settings.LANES and self._statements_of_its_own()

    @staticmethod
    def _statements_of_its_own() -> bool:
        """The messages live in Conf.ORM's database, where this broker's statements run (a router
        that sends them elsewhere leaves the poll and the claim to django-q2's code)."""
        return router.db_for_read(OrmQ) == Conf.ORM and router.db_for_write(OrmQ) == Conf.ORM


def _taken(alias: str, key: str, now: datetime) -> list[tuple[Any, str]]:
    """Up to BULK due messages of `key`, the oldest first, taken in one statement that deletes
    them: a message another pusher took first is gone, and not taken again (PostgreSQL checks the
    condition again on the row it waited for)."""
    connection = connections[alias]
    table, due, read = _oldest_due(connection, outer="")
    now = OrmQ._meta.get_field("lock").get_db_prep_value(now, connection)
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE {due} RETURNING {read}", [key, now, Conf.BULK, now])
        return sorted((row[0], row[1]) for row in cursor.fetchall())


def _claimed(alias: str, key: str, now: datetime, until: datetime) -> list[tuple[Any, str]]:
    """Up to BULK due messages of `key`, the oldest first, claimed in one statement: each one's
    lock moved forward only where it is still due, so a message another pusher claimed first is
    not claimed again (PostgreSQL checks that condition again on the row it waited for). On
    SQLite a poll that finds nothing also takes the write lock, for an instant: a read first would
    spare it that, at one statement more for every message."""
    _, due, read = _oldest_due(connections[alias], outer="t.")
    built = update_sql(OrmQ, {"lock": until}, due,
                       [("key", key), ("lock", now), (None, Conf.BULK), ("lock", now)], returning=read)
    with connections[alias].cursor() as cursor:
        cursor.execute(*built)
        return sorted((row[0], row[1]) for row in cursor.fetchall())


def _oldest_due(connection: Any, *, outer: str) -> tuple[str, str, str]:
    """The message table, the condition "among a key's BULK oldest due messages, and still due"
    over the rows the statement changes (named with the prefix `outer`; parameters: the key, now,
    BULK, now), and the columns a pusher reads back."""
    quote = connection.ops.quote_name

    def column(name: str) -> str:
        return quote(OrmQ._meta.get_field(name).column)

    table, pk, lock = quote(OrmQ._meta.db_table), column("id"), column("lock")
    due = (f"{outer}{pk} IN (SELECT q.{pk} FROM {table} q WHERE q.{column('key')} = %s AND q.{lock} < %s "
           f"ORDER BY q.{pk} LIMIT %s) AND {outer}{lock} < %s")
    return table, due, f"{pk}, {column('payload')}"
