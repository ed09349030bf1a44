"""Hostile input against a live server (gunicorn, as `make run` serves): no input gets a server
error, and the known ones get the documented problem (issue 16). The corpus is what an attacker
and a fuzzer tried: oversized and deeply nested JSON, broken multipart, endless file names,
chunked uploads, wrong methods and content types, and console pages fed garbage."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import socket
import uuid
from urllib.parse import urlsplit

import httpx
import pytest
from django.conf import settings

from console.staff import staff_ensure
from tasks.poc import files
from tasks.services.tenancy import tenant_ensure, token_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def web(transactional_db, tmp_path):
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "web")
    try:
        yield stack.start_web(workers=1, threads=4)
    finally:
        stack.stop_all()


@pytest.fixture
def tenant_api(web):
    token = token_issue(tenant=tenant_ensure(name="acme")).token
    with httpx.Client(base_url=web, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        yield client


def json_body(value) -> dict:
    return {"content": value if isinstance(value, (bytes, str)) else json.dumps(value),
            "headers": {"Content-Type": "application/json"}}


def submission(**extra) -> dict:
    return {"file_id": str(uuid.uuid4()), "kind": "transcription", "target_format": "txt", **extra}


def deep(levels: int) -> str:
    """JSON nested `levels` deep (too deep for json.dumps to write)."""
    return '{"a":' * levels + "{}" + "}" * levels


# (name, method, path, request keyword arguments, expected status, expected code or None)
API_CORPUS = [
    ("json over 1 MB", "POST", "/api/v1/tasks", json_body(submission(params={"x": "y" * 1_100_000})), 413, "payload_too_large"),
    ("100000 open brackets", "POST", "/api/v1/tasks", json_body("[" * 100_000), 400, "invalid_json"),
    ("3000-deep params", "POST", "/api/v1/tasks",
     json_body(json.dumps(submission(params={})).replace('"params": {}', '"params": ' + deep(3000))), 400, "invalid_json"),
    ("not json", "POST", "/api/v1/tasks", json_body("{not json"), 400, "invalid_json"),
    ("invalid utf-8", "POST", "/api/v1/tasks", json_body(b'{"file_id": "\xff\xfe"}'), 400, "invalid_json"),
    ("NaN", "POST", "/api/v1/tasks", json_body('{"file_id": "x", "kind": "transcription", "target_format": "txt", "deadline_s": NaN}'),
     400, "invalid_json"),
    ("huge number", "POST", "/api/v1/tasks", json_body('{"params": {"n": 1e999}}'), 400, "invalid_json"),
    ("NUL in params", "POST", "/api/v1/tasks", json_body(submission(params={"k": "a\u0000b"})), 400, "invalid_json"),
    ("a JSON list", "POST", "/api/v1/tasks", json_body([1, 2]), 400, "invalid_request"),
    ("wrong pairing", "POST", "/api/v1/tasks", json_body(submission(kind="conversion", target_format="srt")), 400, "invalid_request"),
    ("deadline as a string", "POST", "/api/v1/tasks", json_body(submission(deadline_s="3600")), 400, "invalid_request"),
    ("deadline as a bool", "POST", "/api/v1/tasks", json_body(submission(deadline_s=True)), 400, "invalid_request"),
    ("empty body", "POST", "/api/v1/tasks", json_body(b""), 400, "invalid_request"),
    ("application/jsonp", "POST", "/api/v1/tasks", {"content": json.dumps(submission()),
                                                    "headers": {"Content-Type": "application/jsonp"}}, 400, "invalid_request"),
    ("text/plain body", "POST", "/api/v1/tasks", {"content": "hello", "headers": {"Content-Type": "text/plain"}}, 400, "invalid_request"),
    ("key too long", "POST", "/api/v1/tasks", {**json_body(submission()), "headers": {
        "Content-Type": "application/json", "Idempotency-Key": "k" * 300}}, 400, "invalid_request"),
    ("multipart without boundary", "POST", "/api/v1/files", {"content": b"--x\r\nabc\r\n--x--\r\n",
                                                             "headers": {"Content-Type": "multipart/form-data"}}, 400, "invalid_multipart"),
    ("multipart with a 10 kB file name", "POST", "/api/v1/files", {"files": {"file": ("n" * 10_000 + ".wav", files.wav(), "audio/wav")}},
     400, "invalid_multipart"),  # the part's headers are over Django's limit
    ("multipart with a 300-character file name", "POST", "/api/v1/files",
     {"files": {"file": ("n" * 296 + ".wav", files.wav(), "audio/wav")}}, 400, "invalid_request"),
    ("multipart with a long extension", "POST", "/api/v1/files", {"files": {"file": ("a." + "x" * 250, files.wav(), "audio/wav")}},
     201, None),
    ("multipart without the file field", "POST", "/api/v1/files", {"files": {"other": ("a.wav", files.wav(), "audio/wav")}},
     400, "invalid_request"),
    ("X-Filename over 255", "POST", "/api/v1/files", {"content": files.wav(), "headers": {
        "Content-Type": "application/octet-stream", "X-Filename": "f" * 300}}, 400, "invalid_request"),
    ("unknown upload type", "POST", "/api/v1/files", {"content": b"abc", "headers": {"Content-Type": "image/gif"}}, 400, "invalid_request"),
    ("file id not a uuid", "GET", "/api/v1/files/..%2F..%2Fetc%2Fpasswd", {}, 404, None),
    ("task id not a uuid", "GET", "/api/v1/tasks/not-a-uuid", {}, 404, "not_found"),
    ("events of not a uuid", "GET", "/api/v1/tasks/%00/events", {}, 404, None),
    ("limit not a number", "GET", "/api/v1/tasks?limit=abc", {}, 400, "invalid_request"),
    ("limit enormous", "GET", "/api/v1/tasks?limit=99999999999999999999999", {}, 400, "invalid_request"),
    ("unknown state", "GET", "/api/v1/tasks?state=ACCEPTED,,DONE", {}, 400, "invalid_request"),
    ("garbage cursor", "GET", "/api/v1/tasks?cursor=%ff%fe", {}, 400, "invalid_request"),
    ("naive cursor", "GET", "/api/v1/tasks?cursor=MjAyNi0wMS0wMVQwMDowMDowMHwwMDAwMDAwMC0wMDAwLTAwMDAtMDAwMC0wMDAwMDAwMDAwMDA", {},
     200, None),
    ("cancel not a uuid", "POST", "/api/v1/tasks/zzz/cancel", {}, 404, "not_found"),
    ("bad signed link", "GET", "/api/v1/results/abc:def", {}, 404, "not_found"),
    ("unknown vendor channel", "POST", "/api/v1/vendor-callbacks/nope", json_body({}), 404, "not_found"),
    ("unsigned callback", "POST", "/api/v1/vendor-callbacks/primary", json_body({"event_id": "e"}), 401, "bad_signature"),
    ("unknown API path", "GET", "/api/v1/nothing-here", {}, 404, "not_found"),
]


def test_the_api_answers_every_hostile_input_with_a_problem_never_a_server_error(tenant_api):
    wrong = []
    for name, method, path, kwargs, status, code in API_CORPUS:
        answer = tenant_api.request(method, path, **kwargs)
        body = answer.json() if answer.headers.get("content-type", "").startswith("application/") else {}
        if answer.status_code != status or (code and body.get("code") != code):
            wrong.append((name, answer.status_code, body.get("code"), answer.text[:200]))
        if answer.status_code >= 400 and answer.headers.get("content-type") != "application/problem+json":
            wrong.append((name, "not problem+json", answer.headers.get("content-type")))
    assert wrong == []


def test_every_wrong_method_is_405_with_allow(tenant_api):
    paths = {"/api/v1/files": "POST", "/api/v1/tasks": "GET, POST", f"/api/v1/tasks/{uuid.uuid4()}": "GET",
             f"/api/v1/tasks/{uuid.uuid4()}/cancel": "POST", f"/api/v1/tasks/{uuid.uuid4()}/result": "GET",
             "/api/v1/vendor-callbacks/primary": "POST", "/api/v1/openapi.json": "GET"}
    for path, allowed in paths.items():
        for method in ("PUT", "DELETE", "PATCH", "GET", "POST"):
            if method in allowed:
                continue
            answer = tenant_api.request(method, path)
            assert answer.status_code == 405, (method, path)
            assert answer.headers["content-type"] == "application/problem+json"
            assert sorted(answer.headers["allow"].replace(" ", "").split(",")) == sorted(allowed.replace(" ", "").split(",")), path


def test_a_chunked_upload_is_stored_whole(tenant_api):
    content = files.wav(3)

    def pieces():
        for start in range(0, len(content), 7000):
            yield content[start:start + 7000]

    answer = tenant_api.post("/api/v1/files", content=pieces(), headers={"Content-Type": "application/octet-stream",
                                                                         "X-Filename": "call.wav"})
    assert "content-length" not in answer.request.headers and answer.request.headers["transfer-encoding"] == "chunked"
    assert answer.status_code == 201, answer.text
    assert answer.json()["size"] == len(content) and answer.json()["sha256"] == hashlib.sha256(content).hexdigest()


def test_chunked_json_is_bounded_too(tenant_api):
    def pieces():
        yield b'{"file_id": "'
        for _ in range(40):
            yield b"x" * 64 * 1024
        yield b'"}'

    answer = tenant_api.post("/api/v1/tasks", content=pieces(), headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and answer.json()["code"] == "payload_too_large"


def test_a_signed_callback_nested_past_the_limit_is_refused(tenant_api):
    body = deep(3000).encode()
    signature = "sha256=" + hmac.new(settings.VENDOR_WEBHOOK_SECRET.encode(), body, hashlib.sha256).hexdigest()
    answer = tenant_api.post("/api/v1/vendor-callbacks/primary", content=body,
                             headers={"Content-Type": "application/json", "X-Vendor-Signature": signature})
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_request"


def raw_request(base: str, data: bytes) -> bytes:
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as connection:
        connection.sendall(data)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer:
                break
    return answer


@pytest.mark.parametrize("name,request_bytes", [
    ("request line over 8 kB", b"GET /api/v1/tasks?x=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("header over 8 kB", b"GET /api/v1/tasks HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n"),
    ("two content lengths", b"POST /api/v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}"),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
])
def test_requests_the_http_server_refuses_first_are_client_errors(web, name, request_bytes):
    """gunicorn answers these before Sluice sees them (as text, see docs/deployment.md): still 4xx."""
    status = re.match(rb"HTTP/1\.[01] (\d{3})", raw_request(web, request_bytes))
    assert status and 400 <= int(status.group(1)) < 500, name


CONSOLE_GETS = [
    "/console/bulk/cancel/preview/?ids={uuid}", "/console/bulk/cancel/preview/?ids=garbage",
    "/console/bulk/cancel/preview/?nosuch=1", "/console/billing/?days=abc", "/console/billing/?days=999999999999",
    "/console/tasks/task/?created_from=2026-13-45T99:99", "/console/tasks/task/?created_to=yesterday",
    "/console/tasks/task/?nosuch=1", "/console/tasks/task/?created_at__year=abc", "/console/tasks/task/?id=abc",
    "/console/tasks/task/not-a-uuid/change/", "/console/tasks/auditentry/?at__gte=abc",
]
CONSOLE_POSTS = ["/console/task/not-a-uuid/cancel/", "/console/task/{uuid}/cancel/", "/console/quarantine/999/release/",
                 "/console/channel/nope/force/"]


def test_console_pages_answer_garbage_parameters_with_a_message_never_a_server_error(web):
    _, password = staff_ensure(username="root-admin", role="admin", actor="test")
    with httpx.Client(base_url=web, timeout=30, follow_redirects=False) as browser:
        login = browser.get("/console/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
        done = browser.post("/console/login/", data={"username": "root-admin", "password": password,
                                                     "csrfmiddlewaretoken": token, "next": "/console/"})
        assert done.status_code == 302
        wrong = []
        for url in CONSOLE_GETS:
            answer = browser.get(url.format(uuid=uuid.uuid4()))
            if answer.status_code >= 500:
                wrong.append((url, answer.status_code))
            if answer.status_code == 400 and "errornote" not in answer.text:
                wrong.append((url, "400 without a message"))
        csrf = browser.cookies["csrftoken"]
        for url in CONSOLE_POSTS:
            answer = browser.post(url.format(uuid=uuid.uuid4()), data={"state": "NOPE"}, headers={"X-CSRFToken": csrf})
            if answer.status_code >= 500:
                wrong.append((url, answer.status_code))
        assert wrong == []
        assert browser.get("/console/billing/?days=abc").status_code == 400
        assert "days must be a whole number" in browser.get("/console/billing/?days=abc").text
