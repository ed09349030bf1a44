"""What the web server loads with the embedded default: not redis-py (a few MB of resident memory
in every web process, against the bench's 100 MB bound), which only a Redis broker needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LOAD_THE_WEB_APP = """
import sys
import django
django.setup()
import console.wsgi
from django.urls import resolve
resolve("/api/v1/tasks")
import tasks.queueing, tasks.services.intake
print(sorted(name for name in sys.modules if name == "redis" or name.startswith("redis.")))
"""


def test_the_embedded_default_web_app_does_not_load_redis(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(DJANGO_SETTINGS_MODULE="console.settings", SLUICE_DATA_DIR=str(tmp_path))
    loaded = subprocess.run([sys.executable, "-c", LOAD_THE_WEB_APP], env=env, capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2], timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout
