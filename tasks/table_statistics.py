"""PostgreSQL's planner statistics for tables that outgrew them: a young installation's.

PostgreSQL plans every statement from its statistics of each table (how many rows, how values are
spread). A new installation has none until autovacuum analyzes a table, at most once a minute per
database and only once a tenth of the table has changed; until then every index of a small table
costs the same to the planner, and the plan it picks (kept by a connection as a prepared
statement's generic plan) may read a lane's whole backlog to find its oldest task. Measured on a
fresh database: single submissions at 0.33 of the bare view with those plans, 0.39-0.42 with the
tables analyzed every two seconds (docs/performance.md, 2026-12-07).

The dispatcher therefore asks, every STATISTICS_EVERY_S, which tables changed by at least as many
rows as their statistics say they hold (a table that doubled, or was rewritten), and analyzes
those. A table of millions of rows is left to autovacuum (a tenth of it changes first); a table
of a few rows is never worth it. SQLite is never analyzed: its planner uses the indexes' shapes
without statistics, and statistics left behind would change every later plan.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.db import DatabaseError, connection

from tasks.observability import log_event

STATISTICS_EVERY_S = 5.0  # real seconds: a question to the database's own counters, then ANALYZE when due
LEAST_ROWS = 1000  # below this every plan reads a few pages whatever it is

_last_asked = 0.0


@dataclass(frozen=True)
class TableGrowth:
    """What PostgreSQL's counters say of one table: the rows its statistics describe (None: never
    analyzed), the live rows now and the rows written (inserted, updated, deleted) since."""
    name: str
    described_rows: float | None
    live_rows: int
    changed_rows: int

    def needs_statistics(self, *, least: int = LEAST_ROWS) -> bool:
        if max(self.live_rows, self.described_rows or 0) < least:
            return False
        if self.described_rows is None:
            return True
        return self.changed_rows >= max(least, self.described_rows)


def statistics_refresh_due() -> list[str]:
    """The dispatcher's call: at most every STATISTICS_EVERY_S in this process. A failure (the
    database going away mid-pass) is logged and asked again at the next pass: it never stops the
    dispatcher's own work."""
    global _last_asked
    if connection.vendor != "postgresql" or time.monotonic() - _last_asked < STATISTICS_EVERY_S:
        return []
    _last_asked = time.monotonic()
    try:
        return statistics_refresh()
    except DatabaseError as exc:
        log_event("statistics_refresh_failed", logging.WARNING, exception=exc)
        return []


def statistics_refresh() -> list[str]:
    """Analyze this schema's tables that outgrew their statistics; their names. `SKIP_LOCKED`: a
    table someone holds a conflicting lock on (a migration, autovacuum's own ANALYZE) is skipped
    and asked again at the next pass."""
    if connection.vendor != "postgresql":
        return []
    grown = [table.name for table in table_growth() if table.needs_statistics()]
    with connection.cursor() as cursor:
        for name in grown:
            cursor.execute(f"ANALYZE (SKIP_LOCKED) {connection.ops.quote_name(name)}")
    if grown:
        log_event("statistics_refreshed", count=len(grown), reason=",".join(grown))
    return grown


def table_growth() -> list[TableGrowth]:
    """The counters of this schema's tables that this database user may analyze (their owner, the
    database's owner or a superuser: another user's ANALYZE would only warn and skip them, every
    pass), in one statement. PostgreSQL's cumulative statistics, which a backend reports about
    once a second: a second's writes may not be counted yet."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT s.relname, c.reltuples, s.n_live_tup, s.n_mod_since_analyze "
            "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid "
            "WHERE s.schemaname = current_schema() AND (pg_has_role(c.relowner, 'USAGE') "
            "OR pg_has_role((SELECT datdba FROM pg_database WHERE datname = current_database()), 'USAGE') "
            "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)) ORDER BY s.relname")
        return [TableGrowth(name=name, described_rows=None if described < 0 else described,
                            live_rows=live, changed_rows=changed)
                for name, described, live, changed in cursor.fetchall()]
