"""Every fault of the fake vendor, observed from the client side over real sockets."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from fakevendor.control import ControlError
from tests.conftest import CHANNEL_DEFAULTS, TEST_TIME_SCALE

pytestmark = pytest.mark.once

KEY = "dev-vendor-key"
SCALE = TEST_TIME_SCALE


@pytest.fixture
def http(vendor_server):
    with httpx.Client(base_url=vendor_server, headers={"Authorization": f"Bearer {KEY}"}, timeout=5) as client:
        yield client


def upload(http, data: bytes = b"x" * 1000, **kw):
    return http.post("/v1/uploads", content=data, headers={"Content-Type": "application/octet-stream"}, **kw)


def create(http, upload_id: str, *, key: str = "k1", client_ref: str = "ref-1", kind: str = "transcription",
           target: str = "txt", **kw):
    body = {"upload_id": upload_id, "kind": kind, "target_format": target, "client_ref": client_ref, "options": {}}
    return http.post("/v1/jobs", json=body, headers={"Idempotency-Key": key}, **kw)


def ledger(http, client_ref: str | None = None) -> list[dict]:
    params = {"client_ref": client_ref} if client_ref else {}
    return http.get("/v1/usage", params=params).json()["data"]


# --- wire faults ---------------------------------------------------------------------------------
def test_fixed_delay_slows_the_answer(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "delay", "params": {"ms": 4000}})
    started = time.monotonic()
    assert http.get("/v1/jobs", params={"client_ref": "x"}).status_code == 200
    assert time.monotonic() - started >= 4 * SCALE


def test_uniform_and_lognormal_delays_are_accepted_and_bounded(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "delay", "params": {"lower_ms": 100, "upper_ms": 200}})
    assert http.get("/v1/jobs", params={"client_ref": "x"}).status_code == 200
    fake.clear_rules()
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "delay", "params": {"median_ms": 100, "sigma": 0.5, "max_ms": 300}})
    started = time.monotonic()
    assert http.get("/v1/jobs", params={"client_ref": "x"}).status_code == 200
    assert time.monotonic() - started < 300 * SCALE / 1000 + 1


def test_a_stall_without_end_is_a_read_timeout(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "stall", "params": {"ms": None}})
    with pytest.raises(httpx.ReadTimeout):
        http.get("/v1/jobs", params={"client_ref": "x"}, timeout=httpx.Timeout(5, read=0.5))


def test_a_finite_stall_answers_late(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "stall", "params": {"ms": 10000}})
    with pytest.raises(httpx.ReadTimeout):
        http.get("/v1/jobs", params={"client_ref": "x"}, timeout=httpx.Timeout(5, read=0.2))
    fake.clear_rules()
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "stall", "params": {"ms": 6000}})
    started = time.monotonic()
    assert http.get("/v1/jobs", params={"client_ref": "x"}, timeout=5).status_code == 200
    assert time.monotonic() - started >= 6 * SCALE


def test_dribble_sends_the_answer_in_slow_pieces(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "dribble", "params": {"chunks": 4, "total_ms": 8000}})
    create(http, up["upload_id"])
    pieces = []
    started = time.monotonic()
    with http.stream("GET", "/v1/usage") as response:
        for chunk in response.iter_raw():
            pieces.append(time.monotonic() - started)
    assert len(pieces) >= 3 and pieces[-1] >= 8 * SCALE * 0.7


def test_bandwidth_limits_how_fast_an_upload_is_read(fake, http):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "bandwidth", "params": {"bytes_per_s": 50_000}})
    data = os.urandom(200_000)
    started = time.monotonic()
    assert upload(http, data).status_code == 201
    assert time.monotonic() - started >= 200_000 / (50_000 / SCALE) * 0.8


def test_bandwidth_on_the_answer_paces_a_download_and_direction_chooses_the_side(fake, http):
    up = upload(http).json()
    for index in range(6):
        create(http, up["upload_id"], key=f"k{index}", client_ref=f"ref-{index}")
    size = len(http.get("/v1/usage").content)
    rate = 100 / SCALE  # bytes per second, as the rule's 100 B/s is scaled like every duration

    def download() -> tuple[int, int, float]:
        received, pieces, started = 0, 0, time.monotonic()
        with http.stream("GET", "/v1/usage") as response:
            for chunk in response.iter_raw():
                received += len(chunk)
                pieces += 1
        return received, pieces, time.monotonic() - started

    fake.add_rule({"endpoint": "GET /v1/usage", "type": "bandwidth", "params": {"bytes_per_s": 100, "direction": "downstream"}})
    received, pieces, elapsed = download()
    assert received == size and pieces >= 3 and elapsed >= size / rate * 0.8
    fake.clear_rules()
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "bandwidth", "params": {"bytes_per_s": 100, "direction": "upstream"}})
    received, _, fast = download()
    assert received == size and fast < elapsed / 2
    assert fake.journal()[-1]["outcome"] == "ok"


def test_http_error_with_status_code_and_body(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs/*", "type": "http_error", "params": {"status": 502, "code": "bad_gateway"}})
    answer = http.get("/v1/jobs/job_x")
    assert answer.status_code == 502 and answer.json()["code"] == "bad_gateway"
    assert answer.headers["Content-Type"] == "application/problem+json"


def test_rate_limit_with_retry_after_in_seconds(fake, http):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "rate_limit", "params": {"retry_after_s": 7}})
    answer = upload(http)
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "7"
    for header in ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"):
        assert header in answer.headers


def test_rate_limit_with_retry_after_as_an_http_date(fake, http):
    from tasks.vendors.policies import parse_retry_after

    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "rate_limit",
                   "params": {"retry_after_s": 9, "retry_after_date": True, "status": 503}})
    answer = upload(http)
    assert answer.status_code == 503
    assert answer.headers["Retry-After"].endswith("GMT")
    assert 8 <= parse_retry_after(answer.headers["Retry-After"], date_header=answer.headers["Date"]) <= 10


def _server_reset_seen(exc: BaseException) -> bool:
    text = repr(exc) + repr(exc.__cause__) + repr(exc.__context__)
    return "reset" in text.lower() or "broken pipe" in text.lower() or isinstance(exc, httpx.RemoteProtocolError)


def test_reset_before_the_body_is_a_real_tcp_reset(fake, http):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "reset", "params": {"stage": "before_body"}})
    with pytest.raises((httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)) as info:
        upload(http, os.urandom(4 * 1024 * 1024))
    assert _server_reset_seen(info.value)


def test_reset_in_the_middle_of_an_upload_after_n_bytes(fake, http):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "reset", "params": {"stage": "mid_body", "after_bytes": 300_000}})
    with pytest.raises((httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        upload(http, os.urandom(8 * 1024 * 1024))
    entry = [e for e in fake.journal() if e["endpoint"] == "POST /v1/uploads"][-1]
    assert entry["bytes_in"] == 300_000 and entry["outcome"] == "reset mid-body"
    assert fake.invariants()["billed_jobs"] == 0


def test_close_without_any_response(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "close"})
    with pytest.raises(httpx.RemoteProtocolError):
        http.get("/v1/jobs", params={"client_ref": "x"})


def test_garbage_then_close(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "garbage", "params": {"bytes": 32}})
    with pytest.raises(httpx.RemoteProtocolError):
        http.get("/v1/jobs", params={"client_ref": "x"})


@pytest.mark.parametrize("mode,errors", [
    ("reset", (httpx.ReadError, httpx.RemoteProtocolError)),
    ("close", (httpx.RemoteProtocolError,)),
    ("stall", (httpx.ReadTimeout,)),
])
def test_response_lost_leaves_one_billed_job_and_no_answer(fake, http, mode, errors):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": mode}, "times": 1})
    with pytest.raises(errors):
        create(http, up["upload_id"], timeout=httpx.Timeout(5, read=0.5))
    assert len(ledger(http, "ref-1")) == 1
    jobs = http.get("/v1/jobs", params={"client_ref": "ref-1"}).json()["data"]
    assert len(jobs) == 1
    # The same key then replays that job instead of billing another.
    replay = create(http, up["upload_id"])
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == jobs[0]["id"] and len(ledger(http, "ref-1")) == 1


# --- create and job faults ---------------------------------------------------------------------
def test_ignore_idempotency_bills_twice_for_one_key(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "ignore_idempotency"})
    first, second = create(http, up["upload_id"]), create(http, up["upload_id"])
    assert first.status_code == second.status_code == 201 and first.json()["id"] != second.json()["id"]
    assert len(ledger(http, "ref-1")) == 2
    assert fake.invariants()["duplicate_billed_client_refs"][0]["client_ref"] == "ref-1"


def test_duplicate_create_bills_n_jobs_for_one_request(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "duplicate_create", "params": {"copies": 3}})
    assert create(http, up["upload_id"]).status_code == 201
    assert len(ledger(http, "ref-1")) == 3
    assert len(http.get("/v1/jobs", params={"client_ref": "ref-1"}).json()["data"]) == 3


def test_job_fail_with_a_code(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "job_fail", "params": {"code": "bad_audio", "retryable": False}})
    job = create(http, up["upload_id"]).json()
    time.sleep((CHANNEL_DEFAULTS["processing_ms"] + CHANNEL_DEFAULTS["queue_ms"]) / 1000 * SCALE + 0.2)
    view = http.get(f"/v1/jobs/{job['id']}").json()
    assert view["status"] == "failed" and view["error"] == {"code": "bad_audio", "message": "processing failed: bad_audio", "retryable": False}


def test_stuck_keeps_a_job_processing(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "stuck", "params": {"ms": 600_000}})
    job = create(http, up["upload_id"]).json()
    time.sleep(1)
    assert http.get(f"/v1/jobs/{job['id']}").json()["status"] == "processing"


def test_digest_mismatch_in_the_result(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "digest_mismatch"})
    job = create(http, up["upload_id"]).json()
    time.sleep(0.3)
    result = http.get(f"/v1/jobs/{job['id']}/result")
    assert result.status_code == 200
    assert result.headers["X-Content-SHA256"] != hashlib.sha256(result.content).hexdigest()


def test_transient_404_right_after_create(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "transient_404", "params": {"ms": 8000}})
    job = create(http, up["upload_id"]).json()
    assert http.get(f"/v1/jobs/{job['id']}").status_code == 404
    time.sleep(8 * SCALE + 0.1)
    assert http.get(f"/v1/jobs/{job['id']}").status_code == 200


def test_global_rate_limiter_admits_a_burst_then_429s(fake, http):
    fake.channel("default", rate_limit_per_s=1, rate_limit_burst=3)
    statuses = [http.get("/v1/jobs", params={"client_ref": "x"}).status_code for _ in range(6)]
    assert statuses[:3] == [200, 200, 200] and 429 in statuses[3:]


def test_max_concurrent_jobs_rejects_the_excess(fake, http):
    fake.channel("default", max_concurrent_jobs=2, processing_ms=600_000)
    up = upload(http).json()
    answers = [create(http, up["upload_id"], key=f"k{i}", client_ref=f"r{i}").status_code for i in range(3)]
    assert answers == [201, 201, 429]
    assert fake.invariants()["max_concurrent_jobs"] == 2


def test_idempotency_semantics_201_200_409_422(fake, http):
    up = upload(http).json()
    assert create(http, up["upload_id"]).status_code == 201
    assert create(http, up["upload_id"]).status_code == 200
    mismatch = create(http, up["upload_id"], target="srt")
    assert mismatch.status_code == 422 and mismatch.json()["code"] == "idempotency_key_mismatch"
    # A request with the key still in flight: a slow inline create holds the key.
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "bandwidth", "params": {"bytes_per_s": 2_000}, "times": 1})
    data = os.urandom(60_000)
    slow = threading.Thread(target=lambda: http.post(
        "/v1/jobs", content=data, params={"kind": "transcription", "target_format": "txt", "client_ref": "ref-2"},
        headers={"Idempotency-Key": "k2", "Content-Type": "application/octet-stream"}))
    slow.start()
    time.sleep(0.3)
    in_use = http.post("/v1/jobs", content=data, params={"kind": "transcription", "target_format": "txt", "client_ref": "ref-2"},
                       headers={"Idempotency-Key": "k2", "Content-Type": "application/octet-stream"})
    slow.join()
    assert in_use.status_code == 409 and in_use.headers["Retry-After"]


# --- rules: sequence, after, times, probability, determinism ---------------------------------------
def test_sequence_after_and_times(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "sequence": ["rate_limit", "ok", "rate_limit"],
                   "params": {"retry_after_s": 1, "status": 503}, "after": 1})
    statuses = [http.get("/v1/jobs", params={"client_ref": "x"}).status_code for _ in range(6)]
    assert statuses == [200, 503, 200, 503, 200, 200]
    fake.clear_rules()
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "http_error", "params": {"status": 503}, "times": 2})
    assert [http.get("/v1/jobs", params={"client_ref": "x"}).status_code for _ in range(4)] == [503, 503, 200, 200]


def test_the_same_seed_and_request_order_give_the_same_faults(fake, http):
    def run(seed: int) -> list[int]:
        fake.reset()
        fake.set_seed(seed)
        fake.add_rule({"id": "coin", "endpoint": "GET /v1/jobs", "type": "http_error", "params": {"status": 500}, "probability": 0.5})
        return [http.get("/v1/jobs", params={"client_ref": "x"}).status_code for _ in range(24)]

    first, again, other = run(42), run(42), run(43)
    assert first == again
    assert first != other
    assert 4 < first.count(500) < 20
    draws = [e["draw"] for e in fake.journal()]
    assert all(d is not None for d in draws)


def test_match_on_client_ref_and_header(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "match": {"client_ref": "only-me"}, "type": "http_error", "params": {"status": 500}})
    assert create(http, up["upload_id"], client_ref="someone-else", key="a").status_code == 201
    assert create(http, up["upload_id"], client_ref="only-me", key="b").status_code == 500
    fake.add_rule({"endpoint": "* *", "match": {"header": {"X-Canary": "1"}}, "type": "http_error", "params": {"status": 418}})
    assert http.get("/v1/usage", headers={"X-Canary": "1"}).status_code == 418


# --- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,field", [
    ({"endpoint": "POST /v1/jobs", "type": "explode"}, "type"),
    ({"endpoint": "POST /v1/jobs", "type": "http_error", "params": {}}, "params.status"),
    ({"endpoint": "POST /v1/jobs", "type": "rate_limit", "params": {"status": 500}}, "params.status"),
    ({"endpoint": "jobs", "type": "close"}, "endpoint"),
    ({"endpoint": "POST /v1/jobs", "type": "close", "probability": 2}, "probability"),
    ({"endpoint": "POST /v1/jobs", "sequence": ["ok", "boom"]}, "sequence[1]"),
    ({"endpoint": "POST /v1/jobs", "type": "reset", "params": {"stage": "mid_body"}}, "params.after_bytes"),
    ({"endpoint": "POST /v1/jobs", "type": "goaway", "params": {"last_stream_id": "one"}}, "params.last_stream_id"),
    ({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "vanish"}}, "params.mode"),
])
def test_a_malformed_rule_is_400_naming_the_field(fake, rule, field):
    with pytest.raises(ControlError) as info:
        fake.add_rule(rule)
    assert info.value.status == 400 and info.value.field == field


def test_control_calls_need_the_admin_token_and_vendor_calls_need_the_api_key(vendor_server):
    assert httpx.get(f"{vendor_server}/__admin/faults").status_code == 401
    assert httpx.get(f"{vendor_server}/__admin/faults", headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
    assert httpx.get(f"{vendor_server}/v1/usage", headers={"Authorization": "Bearer dev-admin-token"}).status_code == 401


def _raw(vendor_server: str, payload: bytes, *, wait: float = 1.0) -> bytes:
    host, port = vendor_server.replace("http://", "").split(":")
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        sock.sendall(payload)
        sock.settimeout(wait)
        chunks = []
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def test_a_body_longer_than_content_length_is_refused(fake, vendor_server):
    head = f"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/octet-stream\r\nContent-Length: 5\r\n\r\n"
    answer = _raw(vendor_server, head.encode() + b"12345EXTRA-BYTES-THAT-ARE-NOT-HTTP\r\n\r\n")
    assert b" 201 " in answer and b" 400 " in answer  # the upload of 5 bytes, then the garbage refused
    assert fake.invariants()["billed_jobs"] == 0


def test_a_body_shorter_than_content_length_never_becomes_an_upload(fake, vendor_server, http):
    head = f"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/octet-stream\r\nContent-Length: 500\r\n\r\n"
    answer = _raw(vendor_server, head.encode() + b"only-forty-bytes-of-the-promised-five-hundred", wait=0.5)
    assert answer == b""
    assert [e["outcome"] for e in fake.journal() if e["endpoint"] == "POST /v1/uploads"] == ["client_gone"]


def test_signed_callbacks_are_retried_until_acknowledged(fake, http):
    received: list[tuple[dict, str]] = []
    attempts = {"n": 0}

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            attempts["n"] += 1
            if attempts["n"] < 3:
                self.send_response(503)
                self.end_headers()
                return
            received.append((json.loads(body), self.headers["X-Vendor-Signature"], body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        up = upload(http).json()
        body = {"upload_id": up["upload_id"], "kind": "transcription", "target_format": "txt", "client_ref": "cb",
                "options": {}, "callback_url": f"http://127.0.0.1:{server.server_port}/hook"}
        job = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "cb"}).json()
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.shutdown()
    assert received, "no callback arrived"
    event, signature, raw = received[0]
    assert event["event"] == "job.completed" and event["job"]["id"] == job["id"] and event["event_id"]
    expected = hmac.new(CHANNEL_DEFAULTS.get("webhook_secret", "dev-webhook-secret").encode(), raw, hashlib.sha256).hexdigest()
    assert signature == f"sha256={expected}" and attempts["n"] == 3


def test_journal_records_rule_and_outcome_and_reset_clears_it(fake, http):
    fake.add_rule({"id": "five", "endpoint": "GET /v1/jobs", "type": "http_error", "params": {"status": 500}})
    http.get("/v1/jobs", params={"client_ref": "x"})
    entry = fake.journal()[-1]
    assert entry["rule_id"] == "five" and entry["status"] == 500 and entry["outcome"] == "http_error"
    fake.reset()
    assert fake.journal() == [] and fake.rules() == []


def test_in_flight_lists_a_request_while_it_is_answered_and_not_after(fake, http):
    fake.add_rule({"id": "slow", "endpoint": "GET /v1/jobs", "type": "delay", "params": {"ms": 40_000}})
    done = threading.Event()
    worker = threading.Thread(target=lambda: (http.get("/v1/jobs", params={"client_ref": "r-9"}, timeout=30), done.set()))
    worker.start()
    seen: list[dict] = []
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline and not done.is_set():
        seen = [r for r in fake.in_flight() if r["endpoint"] == "GET /v1/jobs"]
        time.sleep(0.01)
    worker.join(30)
    assert seen and seen[0]["client_ref"] == "r-9" and seen[0]["rule_id"] == "slow" and seen[0]["age_ms"] >= 0
    assert not [r for r in fake.in_flight() if r["endpoint"] == "GET /v1/jobs"]
    assert fake.invariants()["requests_in_flight"] == 0


def test_duplicate_on_create_bills_extra_jobs_the_answer_does_not_mention(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "duplicate_on_create", "params": {"copies": 2}, "times": 1})
    answer = create(http, up["upload_id"])
    assert answer.status_code == 201
    listed = http.get("/v1/jobs", params={"client_ref": "ref-1"}).json()["data"]
    assert len(ledger(http, "ref-1")) == 2 and len(listed) == 2
    assert answer.json()["id"] in {j["id"] for j in listed}, "the answer names one of the billed jobs"
    assert create(http, up["upload_id"]).json()["id"] == answer.json()["id"], "the key still replays"


@pytest.mark.parametrize("status", [302, 307])
def test_redirect_answers_a_3xx_with_a_location_and_does_nothing(fake, http, status):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "redirect", "params": {"status": status, "location": "http://elsewhere.invalid/x"}})
    answer = upload(http)
    assert answer.status_code == status and answer.headers["location"] == "http://elsewhere.invalid/x"
    assert fake.journal()[-1]["outcome"] == "redirect"
    fake.clear_rules()
    assert upload(http).status_code == 201


@pytest.mark.parametrize("body", ["not_json", "truncated_json", "missing_fields", "wrong_types", "empty"])
def test_malformed_answers_a_2xx_whose_body_a_client_cannot_use_after_acting(fake, http, body):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "malformed", "params": {"body": body}, "times": 1})
    answer = create(http, up["upload_id"])
    assert 200 <= answer.status_code < 300
    try:
        parsed = answer.json()
    except ValueError:
        parsed = None
    assert not (isinstance(parsed, dict) and isinstance(parsed.get("id"), str) and parsed.get("status") in ("queued", "processing")), parsed
    assert len(ledger(http, "ref-1")) == 1, "the job was created (and billed) although the answer is unusable"


def test_malformed_chunk_answers_a_status_then_garbage_where_the_body_should_be(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "malformed_chunk", "params": {"bytes": 100}})
    with pytest.raises(httpx.RemoteProtocolError):
        create(http, up["upload_id"], client_ref="chunk-ref")
    assert fake.journal(endpoint="POST /v1/jobs")[-1]["outcome"] == "malformed_chunk"
    assert len(ledger(http, "chunk-ref")) == 1, "processed and billed before the broken answer"
    raw = socket.create_connection(("127.0.0.1", int(http.base_url.port)), timeout=5)
    fake.clear_rules()
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "malformed_chunk"})
    raw.sendall(f"GET /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    received = b""
    while chunk := raw.recv(4096):
        received += chunk
    raw.close()
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert rest.startswith(b"zz") and len(rest) == 2 + 64 + 2, "garbage where the first chunk's size belongs"


def test_amnesia_forgets_uploads_jobs_and_keys_but_not_what_was_billed(fake, http):
    up = upload(http).json()
    job = create(http, up["upload_id"]).json()
    forgotten = fake.amnesia()["forgotten"]
    assert forgotten["jobs"] == 1 and forgotten["uploads"] == 1 and forgotten["idempotency"] == 1
    assert http.get(f"/v1/jobs/{job['id']}").status_code == 404
    assert http.get("/v1/jobs", params={"client_ref": "ref-1"}).json()["data"] == []
    assert len(ledger(http, "ref-1")) == 1, "the bill stays"
    assert create(http, up["upload_id"]).status_code in (404, 422), "the upload is gone too"


# --- Toxiproxy's toxics, seen from a client over real sockets ------------------------------------------
def test_timeout_passes_nothing_then_closes_and_the_request_is_not_processed(fake, http):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "timeout", "params": {"ms": 4000}})
    started = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError):
        upload(http)
    assert time.monotonic() - started >= 4 * SCALE
    assert fake.journal()[-1]["outcome"] == "timeout" and fake.journal()[-1]["status"] is None
    fake.clear_rules()
    assert http.get("/v1/usage").json()["data"] == [] and not fake.invariants()["billed_jobs"]


def test_timeout_without_ms_holds_until_the_client_gives_up(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "timeout"})
    with pytest.raises(httpx.ReadTimeout):
        http.get("/v1/jobs", params={"client_ref": "x"}, timeout=httpx.Timeout(5, read=0.3))


def test_reset_peer_resets_the_connection_after_its_delay(fake, http):
    fake.add_rule({"endpoint": "GET /v1/jobs", "type": "reset_peer", "params": {"ms": 4000}})
    started = time.monotonic()
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)) as info:
        http.get("/v1/jobs", params={"client_ref": "x"})
    assert time.monotonic() - started >= 4 * SCALE
    assert _server_reset_seen(info.value)


def test_limit_data_cuts_a_processed_answer_after_n_bytes(fake, http):
    up = upload(http).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "limit_data", "params": {"bytes": 120}})
    with pytest.raises(httpx.RemoteProtocolError):
        create(http, up["upload_id"])
    assert fake.journal()[-1]["outcome"] == "limit_data"
    assert len(ledger(http, "ref-1")) == 1, "the job was created and billed: only its answer was cut"
    raw = socket.create_connection(("127.0.0.1", int(http.base_url.port)), timeout=5)
    fake.clear_rules()
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "limit_data", "params": {"bytes": 50}})
    raw.sendall(f"GET /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    received = b""
    while chunk := raw.recv(4096):
        received += chunk
    raw.close()
    assert len(received) == 50 and received.startswith(b"HTTP/1.1 200")


def test_limit_data_upstream_closes_after_n_bytes_of_the_request_and_nothing_is_processed(fake, http):
    fake.add_rule({"endpoint": "POST /v1/uploads", "type": "limit_data", "params": {"bytes": 200_000, "direction": "upstream"}})
    with pytest.raises((httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError)):
        upload(http, os.urandom(8 * 1024 * 1024))
    entry = [e for e in fake.journal() if e["endpoint"] == "POST /v1/uploads"][-1]
    assert entry["bytes_in"] == 200_000 and entry["outcome"] == "closed mid-body" and entry["status"] is None
    assert upload(http, b"short" * 10).status_code == 201, "a body under the limit goes through"


def test_slow_close_sends_the_whole_answer_then_keeps_the_connection_open_before_closing(fake, http):
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "slow_close", "params": {"ms": 6000}})
    raw = socket.create_connection(("127.0.0.1", int(http.base_url.port)), timeout=10)
    raw.sendall(f"GET /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    started = time.monotonic()
    received, answered_at = b"", None
    while chunk := raw.recv(4096):
        received += chunk
        if answered_at is None and b"\r\n\r\n" in received and received.rstrip().endswith(b"}"):
            answered_at = time.monotonic()
    closed_at = time.monotonic()
    raw.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"200" in head.split(b"\r\n")[0] and json.loads(body)["data"] == []
    assert answered_at is not None and answered_at - started < 6 * SCALE
    assert closed_at - started >= 6 * SCALE, "the close came at once"


def test_a_stack_of_latency_and_a_five_percent_reset_applies_both_to_one_request(fake, http):
    """Toxiproxy's chain: a stacked latency on every call, then a 5 % reset drawn on its own."""
    fake.set_seed(7)
    fake.add_rule({"id": "latency", "endpoint": "GET /v1/jobs", "type": "delay", "params": {"ms": 1000}, "stack": True})
    fake.add_rule({"id": "resets", "endpoint": "GET /v1/jobs", "type": "reset", "toxicity": 0.05})
    outcomes, slow = [], []
    for _ in range(60):
        started = time.monotonic()
        try:
            http.get("/v1/jobs", params={"client_ref": "x"})
            outcomes.append("ok")
        except (httpx.ReadError, httpx.RemoteProtocolError):
            outcomes.append("reset")
        slow.append(time.monotonic() - started >= 1.0 * SCALE)
    assert all(slow), "every call got the latency, reset or not"
    assert 1 <= outcomes.count("reset") <= 10, outcomes.count("reset")
    entries = [e for e in fake.journal() if e["endpoint"] == "GET /v1/jobs"]
    assert {e["rule_id"] for e in entries} == {"latency+resets"}
    assert {e["outcome"] for e in entries if e["status"] is None} == {"reset"}
    rules = {r["id"]: r for r in fake.rules()}
    assert rules["latency"]["applied"] == 60 and rules["latency"]["stack"] is True


def test_the_same_seed_gives_the_same_stack_of_faults(fake, http):
    def run() -> list[str]:
        fake.reset()
        fake.set_seed(11)
        fake.add_rule({"id": "lat", "endpoint": "GET /v1/jobs", "type": "delay", "params": {"ms": 100}, "stack": True})
        fake.add_rule({"id": "err", "endpoint": "GET /v1/jobs", "type": "http_error", "params": {"status": 503}, "toxicity": 0.3})
        return [str(http.get("/v1/jobs", params={"client_ref": "x"}).status_code) for _ in range(20)]

    assert run() == run()


@pytest.mark.parametrize("rule,field", [
    ({"endpoint": "GET /v1/jobs", "type": "reset", "stack": True}, "stack"),
    ({"endpoint": "GET /v1/jobs", "type": "delay", "params": {"ms": 1}, "stack": "yes"}, "stack"),
    ({"endpoint": "GET /v1/jobs", "type": "reset", "toxicity": 2}, "toxicity"),
    ({"endpoint": "GET /v1/jobs", "type": "reset", "toxicity": 0.5, "probability": 0.5}, "toxicity"),
])
def test_stacking_and_toxicity_are_checked(fake, rule, field):
    with pytest.raises(ControlError) as info:
        fake.add_rule(rule)
    assert info.value.status == 400 and info.value.field == field


# --- scenario states (WireMock's scenarios) -----------------------------------------------------------
SUCCEED_HANG_RECOVER = [
    {"id": "first", "endpoint": "POST /v1/jobs", "scenario": "flaky", "type": "ok", "set_state": "hanging"},
    {"id": "hang", "endpoint": "POST /v1/jobs", "scenario": "flaky", "when_state": "hanging", "type": "stall",
     "params": {"ms": None}, "set_state": "recovered"},
    {"id": "recovered", "endpoint": "POST /v1/jobs", "scenario": "flaky", "when_state": "recovered", "type": "ok"},
]


def test_three_rules_in_one_scenario_succeed_then_hang_then_recover_the_same_way_twice(fake, http):
    def run() -> list[str]:
        fake.reset()
        fake.set_seed(3)
        for rule in SUCCEED_HANG_RECOVER:
            fake.add_rule(rule)
        up = upload(http).json()
        seen = []
        for index in range(4):
            try:
                answer = create(http, up["upload_id"], key=f"k-{index}", client_ref=f"ref-{index}",
                                timeout=httpx.Timeout(5, read=0.5))
                seen.append(str(answer.status_code))
            except httpx.ReadTimeout:
                seen.append("hang")
            seen.append(fake.scenarios()["flaky"])
        return seen

    first = run()
    assert first == ["201", "hanging", "hang", "recovered", "201", "recovered", "201", "recovered"]
    assert run() == first
    assert len(ledger(http)) == 3, "the hung create was never processed"


def test_scenario_states_are_listed_reset_and_checked(fake):
    for rule in SUCCEED_HANG_RECOVER:
        fake.add_rule(rule)
    assert fake.scenarios() == {"flaky": "Started"}
    for bad, field in (({"endpoint": "GET /v1/jobs", "type": "ok"}, "type"),
                       ({"endpoint": "GET /v1/jobs", "type": "close", "when_state": "x"}, "when_state"),
                       ({"endpoint": "GET /v1/jobs", "type": "close", "scenario": ""}, "scenario")):
        with pytest.raises(ControlError) as info:
            fake.add_rule(bad)
        assert info.value.field == field
    assert fake.reset_scenarios() == {"flaky": "Started"}
