"""Named locks held until the surrounding transaction ends.

PostgreSQL: transaction-level advisory locks, one statement for all of a caller's locks. SQLite:
every write transaction is IMMEDIATE (console/settings.py), so a writer already excludes every
other and these cost nothing.
"""

from __future__ import annotations

import hashlib

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
    if connection.vendor != "postgresql":
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
    keys = list(dict.fromkeys(lock_key(*name) for name in names))
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(f"pg_try_advisory_xact_lock({key})" for key in keys))
        taken = dict(zip(keys, cursor.fetchone(), strict=True))
    return [bool(taken[lock_key(*name)]) for name in names]
