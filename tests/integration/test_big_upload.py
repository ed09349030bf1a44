"""A 1 GiB upload streams from disk: the client's memory does not grow with the file."""

import os
import subprocess
import sys

import pytest
from django.conf import settings

from tasks.system import database_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.once]
GIB = 1024**3

@pytest.mark.parametrize("mode", ["two_step", "inline"])
def test_a_one_gib_upload_keeps_the_client_under_100_mb(vendor, tmp_path, mode):
    big = tmp_path / "big.bin"
    with open(big, "wb") as handle:
        handle.truncate(GIB)  # sparse: costs no disk until read
    env = {**os.environ, **database_env()}
    channel = "primary" if mode == "two_step" else "fallback"
    done = subprocess.run(
        [sys.executable, "-m", "tasks.bench.upload_probe", str(big), channel, mode],
        cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer, before, peak, _seconds = done.stdout.split()[-4:]
    assert answer.startswith("up_" if mode == "two_step" else "job_")
    assert float(peak) < 100, f"peak RSS {peak} MiB while uploading 1 GiB (before: {before} MiB)"
    upload = [e for e in vendor.control.journal() if e["method"] == "POST"][-1]
    assert upload["bytes_in"] == GIB and upload["status"] == 201
    vendor.control.reset()  # frees the vendor's copy
