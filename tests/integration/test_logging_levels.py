"""django-q2's own log lines follow SLUICE_Q_LOG_LEVEL (WARNING by default, README), whatever
Sluice's own level: at the defaults a submission or a step logs Sluice's events, not django-q2's
"Enqueued …" and "Processed …" for every message."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = pytest.mark.once

PROBE = ("import logging; from django_q.conf import logger; "
         "logger.info('q2-info-probe'); logger.warning('q2-warning-probe'); "
         "logging.getLogger('sluice').info('sluice-info-probe')")


def logged(**env):
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("SLUICE_LOG_LEVEL", "SLUICE_Q_LOG_LEVEL", "SLUICE_LOG_FILE")}
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", PROBE], cwd=Path(settings.BASE_DIR),
                          env={**environment, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_django_q2_logs_warnings_only_by_default_while_sluice_logs_its_events():
    lines = logged()
    assert "sluice-info-probe" in lines
    assert "q2-warning-probe" in lines
    assert "q2-info-probe" not in lines


def test_sluice_q_log_level_turns_django_q2_info_on():
    lines = logged(SLUICE_Q_LOG_LEVEL="INFO")
    assert "q2-info-probe" in lines and "sluice-info-probe" in lines


def test_the_two_levels_are_independent():
    lines = logged(SLUICE_LOG_LEVEL="WARNING", SLUICE_Q_LOG_LEVEL="INFO")
    assert "q2-info-probe" in lines and "sluice-info-probe" not in lines
