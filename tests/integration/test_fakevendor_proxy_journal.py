"""The fake vendor as a QA instrument in front of a real vendor (proxy, record, playback), its
journal (headers and bodies, redacted; find and count) and the slicer, all over real sockets."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from fakevendor.control import VendorControl
from tests.conftest import TEST_TIME_SCALE

pytestmark = pytest.mark.once

KEY = "dev-vendor-key"
ADMIN = "dev-admin-token"


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)


def _upload_and_create(client: httpx.Client, data: bytes, *, key: str, client_ref: str) -> httpx.Response:
    up = client.post("/v1/uploads", content=data, headers={"Content-Type": "application/octet-stream"})
    assert up.status_code == 201, up.text
    body = {"upload_id": up.json()["upload_id"], "kind": "transcription", "target_format": "txt",
            "client_ref": client_ref, "options": {}}
    return client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})


@pytest.fixture
def proxy(vendor_server, fake, tmp_path):
    """A second fake vendor in proxy and record mode, whose upstream is the session's vendor."""
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "proxy")
    recording = tmp_path / "exchanges.jsonl"
    url = stack.start_vendor("proxy", time_scale=TEST_TIME_SCALE,
                             extra_args=("--upstream", vendor_server, "--record", str(recording)))
    yield url, VendorControl(url, ADMIN), recording, stack
    stack.stop_all()


def test_proxy_mode_forwards_to_the_upstream_and_a_rule_on_the_way_loses_a_billed_answer(proxy, fake):
    url, control, _, _ = proxy
    with _client(url) as client:
        created = _upload_and_create(client, b"a" * 5000, key="p-1", client_ref="via-proxy")
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        # The upstream holds the job: the proxy has no state of its own.
        assert fake.ledger()[-1]["job_id"] == job_id
        assert client.get(f"/v1/jobs/{job_id}").json()["id"] == job_id

        control.add_rule({"id": "lost", "endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "reset"}})
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            _upload_and_create(client, b"b" * 5000, key="p-2", client_ref="lost-on-the-way")
        billed = [e for e in fake.ledger() if e["client_ref"] == "lost-on-the-way"]
        assert len(billed) == 1, "the upstream did the work and billed it; only the answer was lost"
        # The client's resend with the same key reaches the upstream's idempotency: no second job.
        control.clear_rules()
        replay = _upload_and_create(client, b"b" * 5000, key="p-2", client_ref="lost-on-the-way")
        assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
        assert len([e for e in fake.ledger() if e["client_ref"] == "lost-on-the-way"]) == 1
        # A wire fault before forwarding: the upstream never sees the request.
        control.add_rule({"endpoint": "GET /v1/usage", "type": "http_error", "params": {"status": 503}})
        seen = len(fake.journal())
        assert client.get("/v1/usage").status_code == 503
        assert [e for e in fake.journal()[seen:] if e["endpoint"] == "GET /v1/usage"] == []
    proxied = control.journal()
    assert {e["outcome"] for e in proxied} >= {"ok", "response_lost:reset", "http_error"}


def test_proxy_mode_passes_the_upstreams_answers_and_credentials_through(proxy):
    url, control, _, _ = proxy
    with httpx.Client(base_url=url, timeout=10) as anonymous:
        refused = anonymous.get("/v1/usage")
    assert refused.status_code == 401 and refused.json()["code"] == "unauthenticated", "the upstream judged the key"
    with _client(url) as client:
        assert client.get("/v1/jobs/job_nope").status_code == 404


def test_record_then_playback_serves_the_same_answers_without_the_upstream(proxy, fake, tmp_path):
    url, control, recording, stack = proxy
    with _client(url) as client:
        created = _upload_and_create(client, b"c" * 3000, key="rec-1", client_ref="recorded")
        job = created.json()
        first = client.get(f"/v1/jobs/{job['id']}").json()
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert [(x["method"], x["status"]) for x in lines] == [("POST", 201), ("POST", 201), ("GET", 200)]
    assert all("authorization" not in {k.lower() for k, _ in x["headers"]} for x in lines)
    assert "Bearer" not in recording.read_text(), "the recording holds no credential"

    played = stack.start_vendor("playback", time_scale=TEST_TIME_SCALE, extra_args=("--playback", str(recording)))
    before = len(fake.journal())
    with _client(played) as client:
        again = client.post("/v1/jobs", json={"anything": 1}, headers={"Idempotency-Key": "x"})
        assert again.status_code == 201 and again.json()["id"] != ""  # the first recorded create
        up_again = client.post("/v1/jobs", json={})
        assert up_again.status_code == 201  # the last recorded answer repeats
        assert client.get(f"/v1/jobs/{job['id']}").json() == first
        missing = client.get("/v1/usage")
        assert missing.status_code == 404 and missing.json()["code"] == "not_recorded"
        # Rules apply in playback too.
        VendorControl(played, ADMIN).add_rule({"endpoint": "GET /v1/jobs/*", "type": "http_error",
                                               "params": {"status": 502}})
        assert client.get(f"/v1/jobs/{job['id']}").status_code == 502
    assert len(fake.journal()) == before, "playback never reached the upstream"


def test_the_journal_keeps_headers_and_bodies_redacted_and_finds_and_counts_entries(fake, vendor_server):
    secret_file = b"PRIVATE-AUDIO-" * 500
    with _client(vendor_server) as client:
        created = _upload_and_create(client, secret_file, key="j-1", client_ref="journal-ref")
        job_id = created.json()["id"]
        fake.add_rule({"id": "err", "endpoint": "GET /v1/jobs/*", "type": "http_error", "params": {"status": 503},
                       "times": 2})
        for _ in range(3):
            client.get(f"/v1/jobs/{job_id}")
        assert client.post("/v1/jobs", json={"upload_id": "nope", "kind": "transcription", "target_format": "txt",
                                             "client_ref": "journal-ref", "api_key": "sk-should-not-stay",
                                             "options": {}}).status_code == 404
    http = httpx.Client(base_url=vendor_server, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    raw = http.get("/__admin/journal", params={"detail": "1"}).text
    assert KEY not in raw and "PRIVATE-AUDIO" not in raw and "sk-should-not-stay" not in raw
    entries = http.get("/__admin/journal", params={"detail": "1", "path": "/v1/uploads"}).json()["data"]
    assert len(entries) == 1
    upload_entry = entries[0]
    assert upload_entry["request"]["headers"]["authorization"] == "[redacted]"
    assert upload_entry["request"]["body"] == {"size": len(secret_file), "sha256": upload_entry["input_sha256"],
                                               "file": True}
    assert json.loads(upload_entry["response"]["body"]["text"])["size"] == len(secret_file)
    assert upload_entry["response"]["status"] == 201

    by_rule = http.get("/__admin/journal", params={"rule": "err"}).json()["data"]
    assert [e["status"] for e in by_rule] == [503, 503], "the third read came after the rule was spent"
    assert http.get("/__admin/journal", params={"status": "5xx"}).json()["data"][0]["rule_id"] == "err"
    counted = http.get("/__admin/journal/count", params={"endpoint": "GET /v1/jobs/*"}).json()
    assert counted["count"] == 3 and counted["by_status"] == {"200": 1, "503": 2}
    assert counted["by_outcome"] == {"http_error": 2, "ok": 1}
    missed = http.get("/__admin/journal", params={"status": "404", "detail": "1"}).json()["data"][0]
    assert json.loads(missed["request"]["body"]["text"])["api_key"] == "[redacted]"
    one = http.get(f"/__admin/journal/{missed['seq']}").json()
    assert one["seq"] == missed["seq"] and one["response"]["status"] == 404
    since = time.time() + 60
    assert http.get("/__admin/journal/count", params={"since": since}).json()["count"] == 0
    bad = http.get("/__admin/journal", params={"status": "teapot"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_filter" and bad.json()["field"] == "status"
    assert http.get("/__admin/journal/999999999").status_code == 404
    http.close()


def test_slicer_sends_the_whole_answer_in_small_delayed_pieces(fake, vendor_server):
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "slicer",
                   "params": {"average_size": 10, "size_variation": 2, "delay_ms": 400}})
    raw = socket.create_connection(("127.0.0.1", int(vendor_server.rsplit(":", 1)[1])), timeout=10)
    raw.sendall(f"GET /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    started = time.monotonic()
    pieces, received = 0, b""
    while not (b"\r\n\r\n" in received and received.endswith(b"}")):
        chunk = raw.recv(4096)
        if not chunk:
            break
        received += chunk
        pieces += 1
    elapsed = time.monotonic() - started
    raw.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["data"] == []
    expected_pieces = len(received) // 12
    assert pieces >= expected_pieces * 0.5, f"{pieces} reads for {len(received)} bytes"
    assert elapsed >= (expected_pieces - 1) * 0.4 * TEST_TIME_SCALE * 0.8, "the pieces came without their delays"
