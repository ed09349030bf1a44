"""A process that vanished inside a transaction must not hold its locks for ever.

A worker cut off from the database (a partition: its packets dropped, nothing reset) or frozen (a
stopped VM, a suspended container) leaves its session open on the server, idle inside its
transaction. The server is never told: PostgreSQL keeps that session, and every lock it holds,
until the client's close reaches it, which after a partition may be never. When that session held
the admission lock, nothing was admitted on any host again (a chaos run stalled with 55 tasks
waiting). Sluice's sessions carry a bound on idle time inside a transaction; the server ends such a
session and its locks go with it. A transaction is never idle that long in Sluice's own work (no
network call inside a transaction), so only a vanished client meets the bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from django.db import connection, transaction
from django.db.utils import OperationalError

from tasks.services.dispatch import dispatch_lock
from tasks.system import BASE, database_env
from tests.conftest import TEST_TIME_SCALE, requires_postgres

pytestmark = [requires_postgres, pytest.mark.django_db(transaction=True)]

HOLDER = """
import os, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup()
from tasks.services.dispatch import dispatch_lock
with dispatch_lock():
    print("held", flush=True)
    time.sleep(600)
"""

# Longer than the bound a worker's session carries at the test time scale, far shorter than never.
GIVE_UP_S = 60


def test_admission_goes_on_after_the_lock_holder_vanished():
    env = {**os.environ, **database_env(), "SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_LOG_LEVEL": "WARNING"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=BASE, env=env, stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert holder.stdout.readline() == b"held\n"
        # Frozen with its connection open: to the server, exactly a client behind a partition.
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{GIVE_UP_S}s"])
                with dispatch_lock():
                    pass
        except OperationalError as error:
            pytest.fail(f"the admission lock was still held after {GIVE_UP_S} s by a vanished session: {error}")
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                           "AND state = 'idle in transaction' AND datname = current_database()")
            assert cursor.fetchone()[0] == 0, "the vanished session is still open"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
