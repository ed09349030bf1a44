"""Named locks held until the surrounding transaction ends.

PostgreSQL: transaction-level advisory locks, one statement for all of a caller's locks. SQLite:
every write transaction is IMMEDIATE (console/settings.py), so a writer already excludes every
other and these cost nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from django.db import connection


def lock_key(*parts: object) -> int:
    """A stable signed 64-bit key for a lock's name (PostgreSQL's advisory lock space)."""
    name = "\x1f".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "big", signed=True)


def are_real() -> bool:
    """Whether these locks exclude anything by themselves (PostgreSQL); on SQLite the write
    transaction already does."""
    return connection.vendor == "postgresql"


def hold(*names: tuple[object, ...], unless_taken: tuple[object, ...] | None = None) -> bool:
    """Inside a transaction: wait for the locks `names`, in the order given (callers agree on one
    order, so two of them never wait for each other). With `unless_taken`, first try that lock
    without waiting: if another transaction holds it, return False at once, holding nothing new.
    Returns True once every lock is held."""
    if connection.vendor != "postgresql" or not (names or unless_taken):
        return True
    if not connection.in_atomic_block:
        raise RuntimeError("a transaction-level lock needs a transaction")
    waits = ", ".join(f"pg_advisory_xact_lock({lock_key(*name)})" for name in names) or "1"
    with connection.cursor() as cursor:
        if unless_taken is None:
            cursor.execute(f"SELECT {waits}")
            return True
        # CASE evaluates the waits only when the try succeeded: a refused try waits for nothing.
        cursor.execute(f"SELECT CASE WHEN pg_try_advisory_xact_lock({lock_key(*unless_taken)}) "
                       f"THEN (SELECT true FROM (SELECT {waits}) AS held) ELSE false END")
        return bool(cursor.fetchone()[0])


def try_each(names: list[tuple[object, ...]]) -> list[bool]:
    """Inside a transaction: try each lock without waiting (one statement); which were taken.
    A name given twice is taken once and reported taken both times (the locks are this
    transaction's own)."""
    if connection.vendor != "postgresql" or not names:
        return [True] * len(names)
    if not connection.in_atomic_block:
        raise RuntimeError("a transaction-level lock needs a transaction")
    sql, taken = try_each_sql(names)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT ({sql})")
        return taken(cursor.fetchone()[0])


def try_each_sql(names: list[tuple[object, ...]]) -> tuple[str, Callable[[list[bool] | None], list[bool]]]:
    """try_each as a subquery for a caller's statement (PostgreSQL, inside a transaction, on this
    module's connection, the default database's: the locks are that transaction's): SQL
    that tries each lock and gives an array of booleans, and what reads try_each's answer from
    that array. Uncorrelated, it runs once in a statement however many rows the statement reads
    (as an InitPlan), and only if a row is read: None read means it did not run."""
    keys = list(dict.fromkeys(lock_key(*name) for name in names))

    def taken(array: list[bool] | None) -> list[bool]:
        if array is None:
            return try_each(names)
        found = dict(zip(keys, array, strict=True))
        return [bool(found[lock_key(*name)]) for name in names]

    return "SELECT ARRAY[" + ", ".join(f"pg_try_advisory_xact_lock({key})" for key in keys) + "]", taken
