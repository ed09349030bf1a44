"""Stored files and results in an S3-compatible bucket (SLUICE_STORAGE_URL), against a real S3
protocol server (moto's server mode) started by the tests; failures of the store injected by the
fake vendor in proxy mode between Sluice and the server."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
import uuid
from pathlib import Path

import httpx
import pytest

from tasks.models import FileVersion, Task
from tests.conftest import TEST_TIME_SCALE, run_until
from tests.support.flows import submit_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.once]

BUCKET = "sluice-store"


@pytest.fixture
def bucket(moto_server, settings, monkeypatch):
    """Sluice's files and results in a fresh prefix of a bucket on the S3 server."""
    import boto3

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing-secret")):
        monkeypatch.setenv(name, value)
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    if BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=BUCKET)
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    settings.STORAGE_URL = f"s3://{BUCKET}/{prefix}"
    settings.S3_ENDPOINT_URL = moto_server
    settings.S3_REGION = "us-east-1"

    def keys(under: str = "") -> list[str]:
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{under}")
        return [o["Key"][len(prefix) + 1:] for o in listed.get("Contents", [])]

    s3.keys = keys
    s3.prefix = prefix
    return s3


def _local_files(settings) -> list[Path]:
    return [p for p in Path(settings.FILES_DIR).rglob("*") if p.is_file()] if Path(settings.FILES_DIR).exists() else []


def test_files_and_results_live_in_the_bucket_and_a_download_is_a_presigned_link(bucket, inline_queue, api, settings):
    before = set(_local_files(settings))
    task_id = submit_file(api)
    file = Task.objects.get(pk=task_id).file
    assert bucket.keys("files/") == [f"files/{file.storage_name}"]
    assert set(_local_files(settings)) == before, "nothing of the upload stayed on this host's disk"
    task = run_until(task_id)
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    assert bucket.keys("results/") == [f"results/{task.result_path}"]
    assert not (Path(settings.RESULTS_DIR) / task.result_path).exists(), "the scratch copy was removed"
    answer = api.get(f"/api/v1/tasks/{task.pk}/result")
    assert answer.status_code == 302 and answer["X-Content-SHA256"] == task.result_sha256
    link = answer["Location"]
    assert "X-Amz-Signature=" in link and f"X-Amz-Expires={int(settings.SIGNED_URL_TTL_S)}" in link
    downloaded = httpx.get(link)
    assert downloaded.status_code == 200 and hashlib.sha256(downloaded.content).hexdigest() == task.result_sha256
    assert "attachment" in downloaded.headers["content-disposition"]
    # A signed link made for someone without a token leads to the same bytes.
    made = api.post(f"/api/v1/tasks/{task.pk}/result-link").json()
    signed = api.get(made["url"].replace("http://testserver", ""))
    assert signed.status_code == 302 and signed["Location"].split("?")[0] == link.split("?")[0]


@pytest.mark.parametrize("size", [48 * 1024 * 1024, pytest.param(1024**3, marks=pytest.mark.slow, id="1GiB")])
def test_a_large_file_goes_up_and_comes_back_in_parts_with_flat_memory(bucket, settings, size):
    """What the API's upload does with the request stream, and what a vendor upload's local copy
    does, measured: memory stays under 40 MiB whatever the size."""
    from tasks.storage import local_copy, store_stream

    piece = os.urandom(64 * 1024)
    expected = hashlib.sha256()

    def chunks():
        for _ in range(size // len(piece)):
            expected.update(piece)
            yield piece

    tracemalloc.start()
    blob = store_stream(chunks(), max_bytes=size)
    _, peak_up = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    with local_copy(blob.storage_name) as copy:
        copied = hashlib.sha256()
        with open(copy, "rb") as handle:
            while chunk := handle.read(1024 * 1024):
                copied.update(chunk)
        _, peak_down = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert not copy.exists(), "the local copy lives only as long as it is used"
    assert blob.size == size and blob.sha256 == expected.hexdigest() == copied.hexdigest()
    for what, peak in (("store", peak_up), ("copy back", peak_down)):
        assert peak < 40 * 1024 * 1024, f"{what}: peak {peak / 2**20:.1f} MiB for {size / 2**20:.0f} MiB"
    head = bucket.head_object(Bucket=BUCKET, Key=f"{bucket.prefix}/files/{blob.storage_name}")
    assert head["ContentLength"] == size and head["ETag"].strip('"').endswith(f"-{size // (8 * 1024 * 1024)}")
    bucket.delete_object(Bucket=BUCKET, Key=f"{bucket.prefix}/files/{blob.storage_name}")


def test_the_store_failing_mid_upload_keeps_nothing_and_a_result_it_fails_to_take_is_fetched_again(
        bucket, inline_queue, api, settings, moto_server, tmp_path):
    from fakevendor.control import VendorControl
    from tasks.services.dispatch import tick
    from tasks.storage import _buckets
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "proxy")
    try:
        proxy = stack.start_vendor("s3-proxy", time_scale=TEST_TIME_SCALE, extra_args=("--upstream", moto_server))
        control = VendorControl(proxy, "dev-admin-token")
        settings.S3_ENDPOINT_URL = proxy
        _buckets.clear()
        # The second part of a multipart upload, and every part after it, is reset on the way.
        control.add_rule({"id": "parts", "endpoint": "PUT *", "type": "reset", "after": 1})
        big = os.urandom(20 * 1024 * 1024)
        refused = api.post("/api/v1/files", data=big, content_type="application/octet-stream", HTTP_X_FILENAME="a.wav")
        assert refused.status_code == 503 and refused.json()["code"] == "storage_unavailable", refused.content
        assert bucket.keys("files/") == [], "nothing half-written became a file"
        assert bucket.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == [], "the partial upload was aborted"
        assert FileVersion.objects.count() == 0
        control.clear_rules()

        task_id = submit_file(api)
        # Every result the pipeline tries to put in the bucket is now refused: the fetch is retried.
        control.add_rule({"id": "results", "endpoint": "PUT *", "type": "http_error", "params": {"status": 503}})
        deadline_ticks = 0
        while Task.objects.get(pk=task_id).fetch_attempts < 2 and deadline_ticks < 2000:
            tick()
            deadline_ticks += 1
        task = Task.objects.get(pk=task_id)
        assert task.state == "RUNNING" and task.phase == "fetch" and task.result_path == ""
        assert bucket.keys("results/") == []
        control.clear_rules()
        task = run_until(task_id)
        assert task.state == "SUCCEEDED" and bucket.keys("results/") == [f"results/{task.result_path}"]
        assert control.journal_count(rule="results")["count"] >= 2
    finally:
        settings.S3_ENDPOINT_URL = moto_server
        _buckets.clear()
        stack.stop_all()
