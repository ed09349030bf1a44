"""SQLite with its writers queued: Django's SQLite backend, plus a lock file beside the database
that a write transaction takes before its BEGIN IMMEDIATE and gives back at its end.

SQLite lets one writer in at a time. The others wait in its busy handler, which sleeps between
tries (1, 2, 5, 10 ... then 100 ms): a waiter learns that the writer left up to 100 ms late, and
one that keeps losing the race to fresh writers can wait for seconds while the cores idle. Here a
writer waits on an advisory lock of its own (flock on `<database>.writer`), trying again every
millisecond at most, so the next writer starts within a millisecond of the last one's end. Its
turn is awaited no longer than the database's `timeout`, with SQLite's error. The kernel drops
a dead process's flocks; a forked child closes the copies it inherited (a copy held open by a
child would keep its dead parent's lock). A write statement run outside a transaction
(autocommit: an INSERT, UPDATE, DELETE or REPLACE) takes the lock for the statement alone; reads
never wait for it. What still waits in SQLite's handler: a writer outside Sluice (another program,
a write beginning with WITH) and whoever meets one.
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import OperationalError
from django.db.backends.sqlite3 import base
from django.utils.asyncio import async_unsafe

from tasks.sqlite_backend import checkpoints

SHORTEST_WAIT_S = 0.0001
LONGEST_WAIT_S = 0.001

_open: weakref.WeakSet[DatabaseWrapper] = weakref.WeakSet()


WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class _Cursor(base.SQLiteCursorWrapper):
    """Django's cursor, whose write statements outside a transaction take the writers' lock."""

    wrapper: DatabaseWrapper

    def execute(self, query, params=None):
        if not self._writes_alone(query):
            return super().execute(query, params)
        with self.wrapper._writer_statement():
            return super().execute(query, params)

    def executemany(self, query, param_list):
        if not self._writes_alone(query):
            return super().executemany(query, param_list)
        with self.wrapper._writer_statement():
            return super().executemany(query, param_list)

    def convert_query(self, query, *, param_names=None):
        if param_names is None:
            return _qmark(query)
        return super().convert_query(query, param_names=param_names)

    def _writes_alone(self, query: str) -> bool:
        """A write statement outside a transaction (a transaction took the lock at its BEGIN)."""
        return not self.connection.in_transaction and query.lstrip()[:7].upper().startswith(WRITES)


@functools.lru_cache(maxsize=4096)
def _qmark(query: str) -> str:
    """A statement's text with Django's %s placeholders as sqlite3's ?, as Django converts it
    (FORMAT_QMARK_REGEX, then %% as %), which it does before every execution: a regular expression
    over the whole text (about 20 µs for a statement of 2 KB; 3–4 % of a submission's time
    in-process). Statements are texts of a few shapes run again and again: each is converted once,
    and the same text object handed to sqlite3 finds its prepared statement without hashing it
    again."""
    return base.FORMAT_QMARK_REGEX.sub("?", query).replace("%%", "%")


class DatabaseWrapper(base.DatabaseWrapper):
    _writer: tuple[int, str, int, weakref.finalize] | None = None  # (pid, path, fd, its closer)

    def get_new_connection(self, conn_params):
        """Django's connection, whose commits leave the WAL's checkpoints to this process's thread
        (checkpoints.py) up to the bound."""
        conn = super().get_new_connection(conn_params)
        if not self.is_in_memory_db():
            conn.execute(f"PRAGMA wal_autocheckpoint = {checkpoints.AUTOCHECKPOINT_PAGES}")
            checkpoints.keep_checkpointed(str(self.settings_dict["NAME"]))
        return conn

    @async_unsafe
    def create_cursor(self, name=None):
        cursor = self.connection.cursor(factory=_Cursor)
        cursor.wrapper = self
        return cursor

    @contextmanager
    def _writer_statement(self) -> Iterator[None]:
        fd = self._writer_fd()
        if fd is None:
            yield
            return
        self._writer_lock(fd)
        try:
            yield
        finally:
            self._writer_unlock()

    def _start_transaction_under_autocommit(self) -> None:
        fd = self._writer_fd()
        if fd is not None:
            self._writer_lock(fd)
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._writer_unlock()
            raise

    def _commit(self) -> None:
        try:
            super()._commit()
        finally:
            self._writer_unlock()

    def _rollback(self) -> None:
        try:
            super()._rollback()
        finally:
            self._writer_unlock()

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._writer_unlock()
            self._writer_forget()

    @property
    def writer_waiting_bound_s(self) -> float:
        return float(self.settings_dict["OPTIONS"].get("timeout", 5))

    def _writer_fd(self) -> int | None:
        if self.is_in_memory_db():
            return None
        path = f"{self.settings_dict['NAME']}.writer"
        if self._writer is not None and self._writer[:2] == (os.getpid(), path):
            return self._writer[2]
        self._writer_forget()
        try:
            # Read-only is enough for flock, and lets any user of the database share the file.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise OperationalError(f"cannot open the writers' lock file: {error.strerror}") from None
        self._writer = (os.getpid(), path, fd, weakref.finalize(self, os.close, fd))
        _open.add(self)
        return fd

    def _writer_lock(self, fd: int) -> None:
        wait, deadline = SHORTEST_WAIT_S, None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.writer_waiting_bound_s
            elif now >= deadline:
                raise OperationalError("database is locked")  # what SQLite's own wait ends with
            time.sleep(wait)
            wait = min(wait * 2, LONGEST_WAIT_S)

    def _writer_unlock(self) -> None:
        # Unconditional (unlocking a lock not held is harmless): a signal between taking the
        # lock and noting it could otherwise leave it held.
        if self._writer is not None and self._writer[0] == os.getpid():
            fcntl.flock(self._writer[2], fcntl.LOCK_UN)

    def _writer_forget(self) -> None:
        """Close this connection's copy of the lock file (never unlocking a parent's: a forked
        child's copy shares the parent's lock, and closing it leaves that lock alone)."""
        if self._writer is not None:
            self._writer[3]()
            self._writer = None


def _after_fork_in_child() -> None:
    for wrapper in list(_open):
        wrapper._writer_forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
