"""SQLite's WAL is checkpointed beside the writers (tasks/sqlite_backend/checkpoints.py): a commit
through Sluice's backend does not copy the WAL back into the database while the writers wait for
it; each process's thread does, once the WAL holds CHECKPOINT_PAGES frames no checkpoint has
copied. Real database files, real threads and a real second process."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
import time

import pytest
from django.conf import settings
from django.db.utils import ConnectionHandler

from tasks.scratch import Scratch
from tasks.sqlite_backend import checkpoints

PAGE = 4096


@pytest.fixture
def database(tmp_path):
    path = str(tmp_path / "c.sqlite3")
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY AUTOINCREMENT, body BLOB)")
    return path


@pytest.fixture
def backend(database, django_db_blocker):
    handler = ConnectionHandler({"default": {"ENGINE": "tasks.sqlite_backend", "NAME": database,
                                             "OPTIONS": {"transaction_mode": "IMMEDIATE"}}})
    connection = handler["default"]
    with django_db_blocker.unblock():  # a database of the test's own, not the project's
        yield connection
        connection.close()


def write_pages(cursor, pages: int) -> None:
    """About `pages` pages of new rows (a row of most of a page each)."""
    cursor.executemany("INSERT INTO t (body) VALUES (randomblob(%s))", [(PAGE - 200,)] * pages)


def test_the_wal_index_says_how_many_frames_no_checkpoint_has_copied(database):
    conn = sqlite3.connect(database, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.executemany("INSERT INTO t (body) VALUES (randomblob(?))", [(PAGE - 200,)] * 300)
    pending = checkpoints.pending_frames(database)

    busy, frames, done = checkpoints.checkpoint(database)

    assert (busy, done) == (0, frames)
    assert pending == frames >= 300  # what SQLite itself found in the WAL
    assert checkpoints.pending_frames(database) == 0
    conn.executemany("INSERT INTO t (body) VALUES (randomblob(?))", [(PAGE - 200,)] * 10)
    # The WAL started again from its beginning: it holds the ten rows' pages (and their table's
    # and index's), not the 300 before them.
    assert 10 <= checkpoints.pending_frames(database) < 60
    conn.close()


def test_a_commit_leaves_the_wal_to_the_thread_which_checkpoints_it_past_the_mark(backend, database):
    with backend.cursor() as cursor:
        cursor.execute("PRAGMA wal_autocheckpoint")
        assert cursor.fetchone()[0] == checkpoints.AUTOCHECKPOINT_PAGES
    assert (os.getpid(), database) in checkpoints._started

    backend.set_autocommit(False)
    with backend.cursor() as cursor:
        write_pages(cursor, 2 * checkpoints.CHECKPOINT_PAGES)
    backend.commit()
    backend.set_autocommit(True)

    deadline = time.monotonic() + 20 * checkpoints.CHECK_EVERY_S
    pending = checkpoints.pending_frames(database)
    while (pending is None or pending >= checkpoints.CHECKPOINT_PAGES) and time.monotonic() < deadline:
        time.sleep(checkpoints.CHECK_EVERY_S / 5)
        pending = checkpoints.pending_frames(database)
    assert pending is not None and pending < checkpoints.CHECKPOINT_PAGES
    with sqlite3.connect(database) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 2 * checkpoints.CHECKPOINT_PAGES


def test_one_process_at_a_time_checkpoints(database):
    conn = sqlite3.connect(database, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.executemany("INSERT INTO t (body) VALUES (randomblob(?))", [(PAGE - 200,)] * 50)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1] + '.checkpointer', os.O_RDONLY | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n"), database],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert checkpoints.checkpoint(database) is None
        assert checkpoints.pending_frames(database) >= 50  # nothing was copied
    finally:
        holder.kill()
        holder.wait()
    assert checkpoints.checkpoint(database)[0] == 0
    fd = os.open(f"{database}.checkpointer", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # given back: taken at once
    os.close(fd)
    conn.close()


READER = """
import sqlite3, sys
from tasks.sqlite_backend import checkpoints
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("SELECT count(*) FROM t").fetchone()  # its WAL index, mapped and locked
for _ in range(3):
    assert checkpoints.pending_frames(sys.argv[1]) is not None
print("ready", flush=True)
sys.stdin.readline()
conn.execute("INSERT INTO t (body) VALUES (randomblob(100))")
print(conn.execute("SELECT count(*) FROM t").fetchone()[0], flush=True)
"""


# Where SQLite's unix VFS keeps the lock every connection with the WAL index open holds shared
# (the "dead man switch": whoever takes it exclusively is the only one left, and resets the index).
DMS_LOCK_OFFSET = 128


def test_reading_the_wal_index_leaves_the_locks_of_the_process_s_connections_alone(database):
    """SQLite's connections hold POSIX locks on `-shm`; closing any descriptor of that file drops
    every lock its process holds on it. A process whose locks were dropped is taken for gone: the
    next process to open the database resets the index under that process's mapping of it (in
    the benchmark: a web worker killed by SIGBUS)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    reader = subprocess.Popen([sys.executable, "-c", READER, database], cwd=root, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert reader.stdout.readline().strip() == "ready"
        fd = os.open(f"{database}-shm", os.O_RDWR)
        try:
            with pytest.raises(OSError):  # the reader's connection still holds its shared lock
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, DMS_LOCK_OFFSET, os.SEEK_SET)
        finally:
            os.close(fd)
        out, _ = reader.communicate("go\n", timeout=60)
    finally:
        reader.kill()
    assert reader.returncode == 0, f"the reader ended with {reader.returncode}"
    assert out.strip() == "1"


@pytest.mark.skipif(bool(settings.DATABASE_URL), reason="the scratch copies are SQLite files on the embedded setup")
def test_a_scratch_copy_of_the_template_holds_what_is_still_in_its_wal(database, tmp_path):
    """Runs (POC scenarios, benchmarks) start on a copy of a migrated template: pages a commit left
    in the template's WAL for a checkpoint not run yet are part of the copy."""
    conn = sqlite3.connect(database, isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.executemany("INSERT INTO t (body) VALUES (randomblob(?))", [(PAGE - 200,)] * 30)
    assert checkpoints.pending_frames(database) >= 30
    scratch = Scratch(tmp_path / "run")
    scratch.template = database
    (tmp_path / "one").mkdir()

    copy = scratch.database_for(tmp_path / "one", 0)

    with sqlite3.connect(copy) as copied:
        assert copied.execute("SELECT count(*) FROM t").fetchone()[0] == 30
    conn.close()


@pytest.mark.parametrize("pending, due", [(None, False), (0, False), (checkpoints.CHECKPOINT_PAGES - 1, False),
                                          (checkpoints.CHECKPOINT_PAGES, True)])
def test_a_checkpoint_is_due_from_the_mark(pending, due):
    assert checkpoints.checkpoint_due(pending) is due
