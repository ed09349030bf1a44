"""The embedded broker's pushers rest between messages on SQLite: a pusher whose last poll found
nothing asks the database again only when a sender rang the key's doorbell after its message
committed, or QUIET_POLL_S after that poll; elsewhere (PostgreSQL without Redis: pushers on
several machines) they poll as django-q2's do (tasks/brokers.py)."""

from __future__ import annotations

import os
import time

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.models import OrmQ

from tasks import brokers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def embedded_broker():
    if settings.REDIS_URL:
        pytest.skip("the embedded broker's: with REDIS_URL the broker is Redis")


def polls(broker) -> tuple[list | None, int]:
    """What one dequeue returned, and how many statements it ran."""
    with CaptureQueriesContext(connection) as statements:
        found = broker.dequeue()
    return found, len(statements.captured_queries)


@pytest.mark.parametrize("key", ["batch", "sluice-doorbell-probe"])  # a lane's (taken), the control's (claimed)
def test_a_resting_pusher_asks_the_database_again_only_when_its_doorbell_rings(key):
    if connection.vendor != "sqlite":
        pytest.skip("pushers on PostgreSQL poll (test below)")
    pusher, sender = get_broker(key), get_broker(key)
    assert polls(pusher) == (None, 1)  # nothing due: it rests
    for _ in range(3):  # each a pause of POLL, well inside QUIET_POLL_S
        assert polls(pusher) == (None, 0)
    sent = sender.enqueue("payload")  # outside a transaction: rung at once
    assert polls(pusher) == ([(sent, "payload")], 1)
    # After a poll that took something, the next one asks again at once (more may be due than
    # one poll takes), then it rests again.
    assert polls(pusher) == (None, 1)
    assert polls(pusher) == (None, 0)


def test_a_message_sent_inside_a_transaction_rings_when_it_commits_and_not_if_it_rolls_back():
    if connection.vendor != "sqlite":
        pytest.skip("no doorbell on PostgreSQL")
    sender, bell = get_broker("batch"), brokers.Doorbell.of("batch")
    bell.looked()
    with transaction.atomic():
        sender.enqueue("kept")
        assert not bell.rang()  # a pusher woken now would not see it yet
    assert bell.rang()
    bell.looked()
    with pytest.raises(RuntimeError), transaction.atomic():
        sender.enqueue("undone")
        raise RuntimeError("rolled back")
    assert not bell.rang()
    OrmQ.objects.filter(key="batch").delete()


def test_a_ring_that_never_came_delays_a_message_by_the_quiet_bound_at_most():
    # A sender killed between its commit and its ring: its message is written, and nothing rang.
    if connection.vendor != "sqlite":
        pytest.skip("no doorbell on PostgreSQL")
    pusher = get_broker("batch")
    rested_at = time.monotonic()  # at the latest when the poll below found nothing
    assert polls(pusher) == (None, 1)
    lost = OrmQ.objects.create(key="batch", payload="unrung", lock=timezone.now())
    found, statements = polls(pusher)
    while found is None:  # (a pusher that never polls again fails here, not by hanging)
        assert statements == 0 or time.monotonic() >= rested_at + brokers.QUIET_POLL_S
        assert time.monotonic() < rested_at + 10 * brokers.QUIET_POLL_S, "the unrung message was never taken"
        found, statements = polls(pusher)
    assert found == [(lost.pk, "unrung")]
    assert time.monotonic() >= rested_at + brokers.QUIET_POLL_S


def test_a_doorbells_file_stays_small_and_every_ring_is_seen():
    if connection.vendor != "sqlite":
        pytest.skip("no doorbell on PostgreSQL")
    bell = brokers.Doorbell.of("sluice-doorbell-rollover")
    for _ in range(brokers.ROLLOVER_BYTES + 10):
        bell.looked()
        bell.ring()
        assert bell.rang()
    assert os.path.getsize(bell.path) < brokers.ROLLOVER_BYTES


def test_on_postgresql_pushers_poll_every_time():
    # Senders and pushers may be on several machines there: no doorbell a file could ring.
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's pushers rest (tests above)")
    assert brokers.Doorbell.of("batch") is None
    pusher = get_broker("batch")
    assert [polls(pusher) for _ in range(3)] == [(None, 1)] * 3
