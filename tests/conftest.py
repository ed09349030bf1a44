"""Shared fixtures: a real fake vendor on loopback, tenants with tokens, and whole running systems."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
from django.conf import settings

# Every interval in the system runs 20x faster in tests (nothing is mocked).
TEST_TIME_SCALE = 0.05
CHANNEL_DEFAULTS = dict(processing_ms=400, queue_ms=50, rate_limit_per_s=0, max_concurrent_jobs=0,
                        concurrency_mode="reject", cancel_delay_ms=0, max_upload_bytes=4 * 1024**3)


@dataclass
class VendorFixture:
    url: str
    control: object

    def channel_url(self, name: str) -> str:
        return f"{self.url}/{name}"


@pytest.fixture(scope="session")
def vendor_server(tmp_path_factory):
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path_factory.mktemp("vendor"))
    url = stack.start_vendor(time_scale=TEST_TIME_SCALE)
    yield url
    stack.stop_all()


@pytest.fixture
def fake(vendor_server, settings):
    """The fake vendor's control API, reset, with the default channel's test settings."""
    from fakevendor.control import VendorControl

    control = VendorControl(vendor_server, settings.FAKEVENDOR_ADMIN_TOKEN)
    control.reset()
    control.set_seed(1)
    control.channel("default", **CHANNEL_DEFAULTS)
    return control


@pytest.fixture
def vendor(vendor_server, transactional_db, settings):
    """The fake vendor, reset, with Sluice's channels pointing at it."""
    from fakevendor.control import VendorControl
    from tasks.models import VendorChannel

    settings.TIME_SCALE = TEST_TIME_SCALE
    control = VendorControl(vendor_server, settings.FAKEVENDOR_ADMIN_TOKEN)
    control.reset()
    control.set_seed(1)
    for name in ("primary", "fallback", "default"):
        control.channel(name, **CHANNEL_DEFAULTS)
    for name in ("primary", "fallback"):
        VendorChannel.objects.filter(name=name).update(base_url=f"{vendor_server}/{name}")
    # These tests drive the fake vendor's channels: the local engine (first for conversions where
    # it is installed) steps aside; tests/integration/test_local_engine.py uses it.
    VendorChannel.objects.filter(name="local").update(enabled=False)
    return VendorFixture(url=vendor_server, control=control)


@pytest.fixture
def tenant(db):
    from tasks.services.tenancy import tenant_ensure

    return tenant_ensure(name="acme")


@pytest.fixture
def token(tenant):
    from tasks.services.tenancy import token_issue

    return token_issue(tenant=tenant).token


@pytest.fixture
def api(client, token):
    """A Django test client that sends the tenant's bearer token."""
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return client


@pytest.fixture
def system(vendor, tmp_path):
    """Dispatcher plus one django-q2 cluster per lane (and the control cluster), as real processes."""
    from tasks.system import Stack

    stack = Stack(
        log_dir=tmp_path / "system",
        env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05"},
    )
    try:
        stack.start_dispatcher()
        stack.start_all_clusters(workers=1)
        yield stack
    finally:
        stack.stop_all()


def wait_for(predicate, *, timeout: float = 30.0, interval: float = 0.1, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def postgres_available() -> bool:
    return settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


requires_postgres = pytest.mark.skipif(
    not os.environ.get("DATABASE_URL"), reason="needs PostgreSQL: set DATABASE_URL"
)


@pytest.fixture
def inline_queue(monkeypatch, vendor):
    """Queue messages run at once in this process (django-q2's sync mode): the real dispatcher,
    steps, database and fake vendor, without worker processes. For delivery semantics use `system`."""
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", True)
    return vendor


def run_until(task_id, *, states=("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"), timeout: float = 30.0):
    """Tick the real dispatcher (with inline_queue: steps run synchronously) until the task is in `states`."""
    from tasks.models import Task
    from tasks.services.dispatch import tick

    deadline = time.monotonic() + timeout
    while True:
        tick()
        task = Task.objects.get(pk=task_id)
        if task.state in states:
            return task
        if time.monotonic() > deadline:
            history = list(task.events.values_list("from_state", "to_state", "reason"))
            raise AssertionError(f"task stuck in {task.state} ({task.error_code}); history: {history}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """A real S3 + Transcribe protocol server (moto's server mode) on loopback, for the session."""
    import subprocess
    import sys

    import httpx

    from tasks.system import free_port

    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/moto-api/", timeout=1)
            break
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the S3/Transcribe server did not start") from None
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(10)
    log.close()



@pytest.fixture(scope="session", autouse=True)
def suite_bucket(request):
    """SLUICE_STORAGE_URL=s3://bucket/prefix without an endpoint runs the whole session against a
    real S3 protocol server started here (make test-s3): every stored file and result goes there."""
    if not os.environ.get("SLUICE_STORAGE_URL") or os.environ.get("SLUICE_S3_ENDPOINT_URL"):
        yield None
        return
    from urllib.parse import urlsplit

    import boto3

    url = request.getfixturevalue("moto_server")
    os.environ.update(SLUICE_S3_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing-secret")
    settings.S3_ENDPOINT_URL = url
    bucket = urlsplit(os.environ["SLUICE_STORAGE_URL"]).netloc
    boto3.client("s3", endpoint_url=url, region_name=settings.S3_REGION).create_bucket(Bucket=bucket)
    yield url
