"""Sluice's django-q2 worker waits for work without holding the task queue's read lock."""

import threading
import time

from django_q.queues import Queue

from tasks.q2pool import NonBlockingReads


def test_a_waiting_worker_holds_no_lock_and_takes_the_message_when_it_comes():
    task_queue = Queue()
    taken: list = []
    waiter = threading.Thread(target=lambda: taken.append(NonBlockingReads(task_queue).get()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    # Free while a worker waits: another worker (or one reincarnated after a kill) can read.
    assert task_queue._rlock.acquire(False)
    task_queue._rlock.release()
    task_queue.put({"name": "a message"})
    waiter.join(timeout=5)
    assert taken == [{"name": "a message"}]


def test_stop_still_ends_the_worker_loop():
    task_queue = Queue()
    for item in ("one", "two", "STOP", "never"):
        task_queue.put(item)
    time.sleep(0.1)  # the queue's feeder thread writes to the pipe
    assert list(iter(NonBlockingReads(task_queue).get, "STOP")) == ["one", "two"]


def test_a_message_it_cannot_take_yet_does_not_make_it_spin():
    """Another reader holds the lock (or died holding it): the waiter pauses between tries."""
    task_queue = Queue()
    task_queue.put("a message")
    time.sleep(0.1)
    tries = []

    class Counting:
        _poll = task_queue._poll

        def get(self, block=True):
            tries.append(1)
            return task_queue.get(block=block)

    assert task_queue._rlock.acquire(False)  # held by "another reader"
    taken: list = []
    waiter = threading.Thread(target=lambda: taken.append(NonBlockingReads(Counting()).get()), daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert taken == [] and len(tries) < 500, len(tries)
    task_queue._rlock.release()
    waiter.join(timeout=5)
    assert taken == ["a message"]
