"""django-q2's ORM broker (the embedded default), with a cheaper acknowledgement and send.

django-q2 deletes an acknowledged message through Django's deletion collector, which opens a
transaction of its own around the one DELETE (a BEGIN on SQLite, two round trips more on
PostgreSQL) for every message. A message row has nothing that cascades or listens: one DELETE
statement, atomic by itself, does the same. A message is written with an INSERT built once
(`tasks.rows.insert_rows`), not through the query compiler: a submission writes one. And the
pusher's poll (ten times a second in every cluster) and its claim of a message are read and
written the same way, as django-q2 reads and writes them.
"""

from __future__ import annotations

from time import sleep
from typing import Any

from django.db import router
from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.models import OrmQ

from tasks.rows import insert_rows, select, update


class Orm(ORM):
    def delete(self, task_id: Any) -> None:
        rows = self.get_connection().filter(pk=task_id)
        rows._raw_delete(rows.db)

    def enqueue(self, task: Any) -> Any:
        self.get_connection()  # what django-q2's does first (old connections closed outside a transaction)
        return insert_rows([OrmQ(key=self.list_key or Conf.CLUSTER_NAME, payload=task, lock=timezone.now())],
                          return_pk=True, using=Conf.ORM)

    def enqueue_many(self, packages: list[str]) -> None:
        """Messages written in one statement (a batch submission's pre-checks)."""
        self.get_connection()
        now = timezone.now()
        insert_rows([OrmQ(key=self.list_key or Conf.CLUSTER_NAME, payload=package, lock=now) for package in packages],
                    using=Conf.ORM)

    def dequeue(self) -> list[tuple[Any, str]] | None:
        """django-q2's: up to BULK messages due, each claimed by moving its lock forward only if
        no other cluster moved it first; None (after a pause of POLL) when none is due."""
        if router.db_for_read(OrmQ) != Conf.ORM or router.db_for_write(OrmQ) != Conf.ORM:
            return super().dequeue()
        self.get_connection()
        due = select(OrmQ, "t.key = %s AND t.lock < %s LIMIT %s",
                     [("key", self.list_key), ("lock", timezone.now()), (None, Conf.BULK)])
        if not due:
            sleep(Conf.POLL)
            return None
        return [(message.pk, message.payload) for message in due
                if update(OrmQ, {"lock": self.timeout(message)}, "t.id = %s AND t.lock = %s",
                          [("id", message.pk), ("lock", message.lock)])]
