"""No published default secret in production (issue 16): the web process refuses the development
key with debug off, and the fake vendor refuses its development admin token beyond loopback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

pytestmark = pytest.mark.once

BASE = Path(settings.BASE_DIR)


def run(command, **env):
    environment = {**os.environ, "SLUICE_SECRET_KEY": "", "SLUICE_SECRET_KEY_FILE": "/nonexistent/secret_key", **env}
    return subprocess.run(command, cwd=BASE, env=environment, capture_output=True, text=True, timeout=120)


def test_the_web_process_refuses_the_development_key_with_debug_off():
    done = run([sys.executable, "-m", "gunicorn", "--check-config", "console.wsgi"], SLUICE_DEBUG="0")
    assert done.returncode != 0
    assert "Refusing to serve with the published development SECRET_KEY" in done.stdout + done.stderr


def test_it_serves_with_a_key_of_its_own_or_in_debug():
    assert run([sys.executable, "-m", "gunicorn", "--check-config", "console.wsgi"], SLUICE_DEBUG="0",
               SLUICE_SECRET_KEY="a-key-of-this-installation-" + "x" * 30).returncode == 0
    assert run([sys.executable, "-m", "gunicorn", "--check-config", "console.wsgi"], SLUICE_DEBUG="1").returncode == 0


def test_make_install_keeps_a_key_for_this_installation():
    key = BASE / "var" / "secret_key"
    assert key.is_file() and len(key.read_text().strip()) >= 40 and key.read_text().strip() != settings.DEV_SECRET_KEY
    assert settings.SECRET_KEY != settings.DEV_SECRET_KEY


def test_the_fake_vendor_refuses_its_development_admin_token_beyond_loopback():
    done = run([sys.executable, "manage.py", "fakevendor", "--host", "0.0.0.0", "--port", "0"],
               FAKEVENDOR_ADMIN_TOKEN="")  # unset: the development default
    assert done.returncode != 0 and "published development admin token" in done.stderr
