"""SQLite's writers queue on a lock file beside the database (tasks/sqlite_backend): a write
transaction takes it before BEGIN IMMEDIATE and gives it back however the transaction ends, a
write statement outside a transaction holds it for the statement, and both wait for it no longer
than the database's timeout, failing as SQLite would. Each test uses a database of its own and a
second real process as the other writer."""

from __future__ import annotations

import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler

TIMEOUT_S = 1
HOLDER = """
import fcntl, os, sqlite3, sys, time
db, hold_s, ready, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
fd = os.open(db + ".writer", os.O_RDWR | os.O_CREAT)
if mode != "sqlite only":
    fcntl.flock(fd, fcntl.LOCK_EX)
if mode == "flock only":  # the lock file alone, given back with a note first
    open(ready, "w").close()
    time.sleep(hold_s)
    open(ready + ".released", "w").close()
    fcntl.flock(fd, fcntl.LOCK_UN)
    time.sleep(60)
    sys.exit(0)
conn = sqlite3.connect(db, isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
conn.execute("INSERT INTO t (who) VALUES ('holder')")
open(ready, "w").close()
time.sleep(hold_s)
conn.execute("COMMIT")
"""


FORKING_WRITER = """
import os, sys, time
import django
from django.conf import settings
settings.configure()
django.setup()
from django.db.utils import ConnectionHandler
connection = ConnectionHandler({"default": {"ENGINE": "tasks.sqlite_backend", "NAME": sys.argv[1]}})["default"]
connection.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)  # holds the lock
if os.fork() == 0:
    # Said by the child once fork has returned in it (after what runs at fork).
    with open(sys.argv[2] + ".tmp", "w") as ready:
        ready.write(str(os.getpid()))
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.fixture
def writer(tmp_path, django_db_blocker):
    path = str(tmp_path / "w.sqlite3")
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY AUTOINCREMENT, who TEXT)")
    handler = ConnectionHandler({"default": {"ENGINE": "tasks.sqlite_backend", "NAME": path,
                                             "OPTIONS": {"timeout": TIMEOUT_S, "transaction_mode": "IMMEDIATE"}}})
    connection = handler["default"]
    with django_db_blocker.unblock():  # a database of the test's own, not the project's
        yield connection
        connection.close()


def write(connection, who: str, *, fail: bool = False) -> None:
    """What transaction.atomic does with a connection: begin, write, commit (or roll back)."""
    connection.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
    try:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO t (who) VALUES (%s)", [who])
        if fail:
            raise RuntimeError("the transaction's work failed")
        connection.commit()
    except BaseException:
        connection.rollback()
        raise
    finally:
        connection.set_autocommit(True)


def lock_is_free(connection) -> bool:
    fd = os.open(connection.settings_dict["NAME"] + ".writer", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def hold(connection, tmp_path, seconds: float, *, mode: str = "flock") -> subprocess.Popen:
    """A process that holds the lock file and SQLite's write lock ("flock"), SQLite's alone
    ("sqlite only", as a program outside Sluice would) or the lock file alone ("flock only", which
    notes `<ready>.released` just before it gives the lock back)."""
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, connection.settings_dict["NAME"], str(seconds), str(ready),
                               mode])
    holder.ready = ready
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert holder.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.01)
    return holder


def rows(connection) -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT who FROM t ORDER BY id")
        return [who for (who,) in cursor.fetchall()]


def test_a_writer_waits_for_the_one_holding_the_lock_and_writes_after_it(writer, tmp_path):
    holder = hold(writer, tmp_path, 0.5)
    write(writer, "waiter")
    assert holder.wait(timeout=30) == 0
    assert rows(writer) == ["holder", "waiter"]
    assert lock_is_free(writer)


def test_the_lock_is_given_back_however_the_transaction_ends(writer):
    write(writer, "committed")
    assert lock_is_free(writer)
    with pytest.raises(RuntimeError):
        write(writer, "rolled back", fail=True)
    assert lock_is_free(writer)
    writer.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
    assert not lock_is_free(writer)  # held for the transaction, by this process
    writer.close()
    assert lock_is_free(writer)
    assert rows(writer) == ["committed"]


def test_a_writer_waits_no_longer_than_the_timeout_and_fails_as_sqlite_does(writer, tmp_path):
    holder = hold(writer, tmp_path, 10 * TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(OperationalError, match="database is locked"):
        write(writer, "impatient")
    assert TIMEOUT_S <= time.monotonic() - started < 5 * TIMEOUT_S
    holder.kill()  # a process that dies holding the lock frees it
    holder.wait(timeout=30)
    write(writer, "after")
    assert rows(writer) == ["after"]


def test_a_begin_refused_by_sqlite_itself_leaves_the_lock_free(writer, tmp_path):
    # A writer outside the lock (a statement in autocommit, another program) holds SQLite's own.
    holder = hold(writer, tmp_path, 10 * TIMEOUT_S, mode="sqlite only")
    try:
        with pytest.raises(OperationalError, match="database is locked"):
            write(writer, "refused")
        assert lock_is_free(writer)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def autocommit_write(connection, who: str) -> None:
    """A statement outside a transaction, as `Model.objects.filter(...).update(...)` runs one."""
    assert connection.get_autocommit() and not connection.in_atomic_block
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO t (who) VALUES (%s)", [who])


def test_a_write_outside_a_transaction_waits_for_the_lock_too(writer, tmp_path):
    holder = hold(writer, tmp_path, 0.5, mode="flock only")
    try:
        autocommit_write(writer, "statement")
        # SQLite itself was free all along: only the lock file could have held the write back.
        assert Path(f"{holder.ready}.released").exists()
        assert lock_is_free(writer)  # held for the statement alone
        assert rows(writer) == ["statement"]
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_write_outside_a_transaction_waits_no_longer_than_the_timeout(writer, tmp_path):
    holder = hold(writer, tmp_path, 10 * TIMEOUT_S, mode="flock only")
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError, match="database is locked"):
            autocommit_write(writer, "impatient")
        assert TIMEOUT_S <= time.monotonic() - started < 5 * TIMEOUT_S
        assert rows(writer) == []  # reads never wait for the lock
    finally:
        holder.kill()
        holder.wait(timeout=30)
    autocommit_write(writer, "after")
    assert rows(writer) == ["after"]


def test_a_writer_killed_holding_the_lock_frees_it_though_its_forked_child_lives_on(writer, tmp_path):
    # django-q2's sentinel forks its workers: a child must not keep its dead parent's lock.
    ready = tmp_path / "ready"
    parent = subprocess.Popen([sys.executable, "-c", FORKING_WRITER, writer.settings_dict["NAME"], str(ready)],
                              cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert parent.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.01)
    child = int(ready.read_text())
    try:
        assert not lock_is_free(writer)
        parent.kill()
        parent.wait(timeout=30)
        assert os.path.exists(f"/proc/{child}")
        assert lock_is_free(writer)
    finally:
        os.kill(child, signal.SIGKILL)


def test_closing_a_connection_closes_its_copy_of_the_lock_file(writer):
    # A server that starts a thread per request gets a connection per thread: none may leave a
    # file open behind it.
    lock_file = writer.settings_dict["NAME"] + ".writer"

    def copies_open() -> int:
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += os.readlink(f"/proc/self/fd/{fd}") == lock_file
            except OSError:
                pass  # closed meanwhile (the listing's own descriptor)
        return found

    connections = []
    for n in range(20):
        connections.append(ConnectionHandler({"default": writer.settings_dict})["default"])
        write(connections[-1], f"row {n}")
        connections[-1].close()
    assert copies_open() == 0
    assert len(rows(writer)) == 20
