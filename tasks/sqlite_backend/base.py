"""SQLite with its writers queued: Django's SQLite backend, plus a lock file beside the database
that a write transaction takes before its BEGIN IMMEDIATE and gives back at its end.

SQLite lets one writer in at a time. The others wait in its busy handler, which sleeps between
tries (1, 2, 5, 10 ... then 100 ms): a waiter learns that the writer left up to 100 ms late, and
one that keeps losing the race to fresh writers can wait for seconds while the cores idle. Here a
writer waits on an advisory lock of its own (flock on `<database>.writer`), trying again every
millisecond at most, so the next writer starts within a millisecond of the last one's end. The
wait is bounded by the database's `timeout`, as SQLite's own is, with the same error. A process
that dies holding the lock frees it (the kernel drops a dead process's flocks); statements run
outside a transaction (autocommit) still wait in SQLite's handler, as before.
"""

from __future__ import annotations

import fcntl
import os
import time

from django.db import OperationalError
from django.db.backends.sqlite3 import base

SHORTEST_WAIT_S = 0.0001
LONGEST_WAIT_S = 0.001


class DatabaseWrapper(base.DatabaseWrapper):
    _writer: tuple[int, int] | None = None  # (pid, fd): a forked child opens its own description
    _holding = False

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

    @property
    def writer_waiting_bound_s(self) -> float:
        return float(self.settings_dict["OPTIONS"].get("timeout", 5))

    def _writer_fd(self) -> int | None:
        if self.is_in_memory_db():
            return None
        pid = os.getpid()
        if self._writer is None or self._writer[0] != pid:
            # flock belongs to the open file description: one inherited over fork would be shared
            # with the parent, so a child opens its own (and leaves the parent's alone).
            path = f"{self.settings_dict['NAME']}.writer"
            self._writer = (pid, os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            self._holding = False
        return self._writer[1]

    def _writer_lock(self, fd: int) -> None:
        wait, deadline = SHORTEST_WAIT_S, None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._holding = True
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
        if self._holding and self._writer is not None and self._writer[0] == os.getpid():
            self._holding = False
            fcntl.flock(self._writer[1], fcntl.LOCK_UN)
