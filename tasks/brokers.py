"""django-q2's ORM broker (the embedded default), with a cheaper acknowledgement.

django-q2 deletes an acknowledged message through Django's deletion collector, which opens a
transaction of its own around the one DELETE (a BEGIN on SQLite, two round trips more on
PostgreSQL) for every message. A message row has nothing that cascades or listens: one DELETE
statement, atomic by itself, does the same.
"""

from __future__ import annotations

from typing import Any

from django_q.brokers.orm import ORM


class Orm(ORM):
    def delete(self, task_id: Any) -> None:
        rows = self.get_connection().filter(pk=task_id)
        rows._raw_delete(rows.db)
