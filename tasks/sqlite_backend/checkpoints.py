"""SQLite's WAL checkpoints, run beside the writers instead of inside a writer's commit.

In WAL mode every commit appends its pages to `<database>-wal`; a checkpoint copies them back
into the database file and syncs it. By default SQLite checkpoints inside the commit that takes
the WAL past 1,000 pages: that writer copies and syncs while it still holds the writers' lock
(tasks/sqlite_backend/base.py), and every other writer waits for it. Here each process that
opens a connection keeps a thread that reads how many frames the WAL holds that no checkpoint
has copied yet (the wal-index header in `<database>-shm`, a documented format:
https://www.sqlite.org/walformat.html) every CHECK_EVERY_S, and past CHECKPOINT_PAGES runs a
PASSIVE checkpoint on a connection of its own, which waits for no reader or writer and is waited
for by none; one process at a time (a lock file), the others' threads ask again at their next
read. Connections keep SQLite's own checkpoint in the commit, at AUTOCHECKPOINT_PAGES: a bound on
the WAL for the time no thread has checkpointed (a process stopped between two reads, the threads
of every process gone).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import struct
import threading
import time

from tasks.observability import log_event

# What the thread keeps the WAL under: SQLite's own default for the commit's checkpoint.
CHECKPOINT_PAGES = 1_000
# The commit's own checkpoint, as a bound: reached only when no thread has checkpointed.
AUTOCHECKPOINT_PAGES = 10_000
# How often a process's thread reads the WAL's header (real seconds; a pread of 100 bytes).
CHECK_EVERY_S = 0.25

WAL_INDEX_VERSION = 3007000
_HEADER = struct.Struct("=III BB H I")  # iVersion, unused, iChange, isInit, bigEndCksum, szPage, mxFrame
_HEADER_BYTES = 48  # a header, written twice one after the other; then the checkpoint's nBackfill
_BACKFILL = struct.Struct("=I")

_started: set[tuple[int, str]] = set()  # (pid, database): its thread runs
_index_fds: dict[tuple[int, str], int] = {}  # (pid, database): its WAL index, open (_index_fd)
_lock = threading.Lock()


def pending_frames(database: str) -> int | None:
    """Frames in the database's WAL that no checkpoint has copied yet, from the wal-index header;
    None when there is no WAL index, or its header is being written now (its two copies differ)."""
    fd = _index_fd(database)
    if fd is None:
        return None
    header = os.pread(fd, 2 * _HEADER_BYTES + _BACKFILL.size, 0)
    if len(header) < 2 * _HEADER_BYTES + _BACKFILL.size or header[:_HEADER_BYTES] != header[_HEADER_BYTES:2 * _HEADER_BYTES]:
        return None
    version, _, _, initialised, _, _, max_frame = _HEADER.unpack_from(header)
    if version != WAL_INDEX_VERSION or not initialised:
        return None
    (backfilled,) = _BACKFILL.unpack_from(header, 2 * _HEADER_BYTES)
    return max(max_frame - backfilled, 0)


def _index_fd(database: str) -> int | None:
    """This process's descriptor of `<database>-shm`, opened once and never closed while that file
    is the one in use: SQLite holds POSIX locks on it, and closing any descriptor of a file drops
    every lock its process holds on that file, whoever took them (another process would then take
    itself for the last user and reset the index under this process's mapping of it). A
    descriptor of a file since replaced (every connection to the database closed, and a new one
    opened) is closed: no connection uses the replaced file any more."""
    path = f"{database}-shm"
    try:
        current = os.stat(path)
    except OSError:
        return None
    key = (os.getpid(), database)
    known = _index_fds.get(key)
    if known is not None:
        held = os.fstat(known)
        if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
            return known
        os.close(known)
        del _index_fds[key]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    _index_fds[key] = fd
    return fd


def checkpoint_due(pending: int | None) -> bool:
    return pending is not None and pending >= CHECKPOINT_PAGES


def checkpoint(database: str) -> tuple[int, int, int] | None:
    """A PASSIVE checkpoint of `database`: (busy, frames in the WAL, frames checkpointed), as
    SQLite's wal_checkpoint pragma answers; None when another process is checkpointing now (one
    at a time holds the lock file `<database>.checkpointer`, so that the threads of several
    processes finding the WAL past the mark at once do not each open a connection to ask).

    The connection is the checkpoint's alone, closed at once: when a process's connections are
    closed, the last one to close checkpoints the whole WAL and removes it, which a connection of
    this thread's kept open would keep from happening."""
    lock_fd = os.open(f"{database}.checkpointer", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        connection = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
        try:
            # Every row fetched: a statement left unfinished would hold a read of the database
            # open, and the WAL could no longer be checkpointed past it.
            ((busy, frames, done),) = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            connection.close()
        return busy, frames, done
    finally:
        os.close(lock_fd)  # (gives the lock back)


def keep_checkpointed(database: str) -> None:
    """Start this process's checkpointing thread for `database` unless it runs already (a forked
    child starts its own: threads do not survive a fork)."""
    key = (os.getpid(), database)
    if key in _started:
        return
    with _lock:
        if key in _started:
            return
        _started.add(key)
    threading.Thread(target=_checkpointing, args=(database,), name="sqlite-checkpoints", daemon=True).start()


def _checkpointing(database: str) -> None:
    failed = False
    while True:
        time.sleep(CHECK_EVERY_S)
        if not os.path.exists(database):  # removed (a scratch or test database): nothing to keep
            with _lock:
                _started.discard((os.getpid(), database))
            return
        try:
            if checkpoint_due(pending_frames(database)):
                checkpoint(database)
            failed = False
        except (OSError, sqlite3.Error) as error:
            if not failed:  # once until it works again, not every quarter of a second
                log_event("wal_checkpoint_failed", logging.WARNING, reason=type(error).__name__,
                          decision="the next commit past the bound checkpoints")
            failed = True


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (a thread of the parent may have held it at the fork)


os.register_at_fork(after_in_child=_after_fork_in_child)
