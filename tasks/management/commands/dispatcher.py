"""`python manage.py dispatcher`: the loop that turns due rows of the task table into messages.

Safe to run on several hosts at once (every pass is a compare-and-set or holds the dispatch lock).
"""

import logging
import signal
import time

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from tasks.observability import log_event
from tasks.services.dispatch import tick


def pause_after_s(interval: float) -> float:
    """How long between two passes' starts reads as a pause of the loop (real seconds)."""
    return max(1.0, 5 * interval)


class Command(BaseCommand):
    help = "Run the dispatcher loop (deadlines, watchdog, retries, admission, polls, notifications)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="One pass, then exit.")

    def handle(self, *args, once: bool = False, **options):
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
        interval = float(settings.DISPATCH_TICK_S)
        full_every = max(float(settings.DISPATCH_FULL_TICK_S), interval)
        log_event("dispatcher_started", delay_s=interval)
        last_full = 0.0
        previous = None
        while not stopping:
            started = time.monotonic()
            if previous is not None and started - previous > pause_after_s(interval):
                # Everything due (retries, admission, deadlines) waited this long: a frozen host,
                # a starved process or a tick that ran long. Said once, when the loop is back.
                log_event("dispatcher_paused", logging.WARNING, duration_ms=int((started - previous) * 1000))
            previous = started
            close_old_connections()
            full = started - last_full >= full_every
            try:
                tick(full=full)
                if full:
                    last_full = started
            except Exception as exc:
                log_event("dispatch_error", 40, exception=exc)
            if once:
                break
            time.sleep(max(interval - (time.monotonic() - started), 0.01))
