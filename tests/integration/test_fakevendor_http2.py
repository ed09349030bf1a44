"""The fake vendor over HTTP/2 with prior knowledge: the contract, multiplexing, a real GOAWAY.

httpx speaks h2c when told `http1=False, http2=True`; the frame-level tests write the client
side with h2 and read the server's frames with hyperframe, so what is asserted is what crossed
the socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from hpack import Decoder
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame

from tests.integration.test_fakevendor_faults import KEY, create, ledger, upload

pytestmark = pytest.mark.once


@pytest.fixture
def h2(vendor_server):
    with httpx.Client(base_url=vendor_server, headers={"Authorization": f"Bearer {KEY}"}, timeout=5,
                      http1=False, http2=True) as client:
        yield client


def test_the_vendor_contract_over_http2(fake, h2):
    data = os.urandom(1024 * 1024)  # bigger than the stream window: flow control both ways
    up = upload(h2, data)
    assert up.status_code == 201 and up.http_version == "HTTP/2"
    assert up.json()["sha256"] == hashlib.sha256(data).hexdigest()
    job = create(h2, up.json()["upload_id"])
    assert job.status_code == 201
    deadline = time.monotonic() + 10
    while (view := h2.get(f"/v1/jobs/{job.json()['id']}").json())["status"] != "completed":
        assert time.monotonic() < deadline, view
        time.sleep(0.05)
    result = h2.get(f"/v1/jobs/{job.json()['id']}/result")
    assert result.status_code == 200 and hashlib.sha256(result.content).hexdigest() == view["result"]["sha256"]
    protocols = {row["protocol"] for row in fake.journal()}
    assert protocols == {"HTTP/2"}
    # The same process keeps serving HTTP/1.1 on the same port.
    with httpx.Client(base_url=str(h2.base_url), headers={"Authorization": f"Bearer {KEY}"}) as h1:
        assert h1.get("/v1/jobs", params={"client_ref": "ref-1"}).http_version == "HTTP/1.1"
    assert fake.journal()[-1]["protocol"] == "HTTP/1.1"


def test_bandwidth_paces_an_answer_over_http2_too(fake, h2):
    from tests.conftest import TEST_TIME_SCALE

    up = upload(h2).json()
    for index in range(6):
        create(h2, up["upload_id"], key=f"k{index}", client_ref=f"ref-{index}")
    size = len(h2.get("/v1/usage").content)
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "bandwidth", "params": {"bytes_per_s": 100, "direction": "downstream"}})
    started = time.monotonic()
    answer = h2.get("/v1/usage")
    assert answer.http_version == "HTTP/2" and len(answer.content) == size
    assert time.monotonic() - started >= size / (100 / TEST_TIME_SCALE) * 0.8


def test_a_stalled_stream_does_not_hold_up_the_others_on_its_connection(fake, vendor_server):
    fake.add_rule({"endpoint": "GET /v1/jobs", "match": {"client_ref": "slow"}, "type": "stall", "params": {"ms": None}})

    async def run():
        async with httpx.AsyncClient(base_url=vendor_server, headers={"Authorization": f"Bearer {KEY}"},
                                     http1=False, http2=True, timeout=httpx.Timeout(5, read=3)) as client:
            slow = asyncio.ensure_future(client.get("/v1/jobs", params={"client_ref": "slow"}))
            await asyncio.sleep(0.1)
            # Were the streams served in turn, these would wait behind the stall and time out.
            answers = await asyncio.gather(*[client.get("/v1/jobs", params={"client_ref": f"r{i}"}) for i in range(20)])
            with pytest.raises(httpx.ReadTimeout):
                await slow
            return answers

    # In a thread of its own: a browser test earlier in the session may own this thread's loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answers = pool.submit(asyncio.run, run()).result()
    assert [a.status_code for a in answers] == [200] * 20
    assert len({a.extensions["network_stream"] for a in answers}) == 1, "all on one connection"


def test_goaway_below_the_stream_means_not_processed_and_the_client_resends(fake, h2):
    up = upload(h2).json()
    fake.add_rule({"id": "bye", "endpoint": "POST /v1/jobs", "type": "goaway", "times": 1})
    answer = create(h2, up["upload_id"])
    # httpx resends a request refused by GOAWAY on a new connection by itself.
    assert answer.status_code == 201
    creates = [r for r in fake.journal() if r["endpoint"] == "POST /v1/jobs"]
    assert [r["outcome"] for r in creates] == ["goaway", "ok"]
    assert creates[0]["rule_id"] == "bye" and creates[0]["job_id"] is None
    assert len(ledger(h2, "ref-1")) == 1


def test_goaway_covering_a_processed_stream_leaves_one_billed_job_and_no_answer(fake, h2):
    up = upload(h2).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "goaway"}, "times": 1})
    with pytest.raises(httpx.RemoteProtocolError):
        create(h2, up["upload_id"])
    assert len(ledger(h2, "ref-1")) == 1
    replay = create(h2, up["upload_id"])
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert len(ledger(h2, "ref-1")) == 1


@pytest.mark.parametrize("rule", [
    {"type": "reset", "params": {"stage": "before_body"}},
    {"type": "reset", "params": {"stage": "mid_body", "after_bytes": 100_000}},
    {"type": "close"},
    {"type": "garbage", "params": {"bytes": 64}},
])
def test_connection_faults_reach_http2_clients(fake, h2, rule):
    fake.add_rule({"endpoint": "POST /v1/uploads", **rule})
    with pytest.raises(httpx.TransportError):
        upload(h2, os.urandom(400_000))
    assert fake.journal()[-1]["protocol"] == "HTTP/2"


# --- frame level -------------------------------------------------------------------------------
class RawH2:
    """The client side encoded by h2; the server's frames read raw, GOAWAY included."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.sock.sendall(self.h2.data_to_send())
        self.buffer = b""
        self.decoder = Decoder()

    def request(self, path: str, *, method: str = "GET", headers: tuple = (), body: bytes = b"") -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, [(":method", method), (":path", path), (":scheme", "http"),
                                         (":authority", "127.0.0.1"), ("authorization", f"Bearer {KEY}"),
                                         *headers], end_stream=not body)
        if body:
            self.h2.send_data(stream_id, body, end_stream=True)
        self.sock.sendall(self.h2.data_to_send())
        return stream_id

    def frames(self, *, timeout: float = 5) -> list[Frame]:
        """Every frame until the server closes the connection."""
        frames: list[Frame] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not data:
                break
            self.buffer += data
            while len(self.buffer) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(self.buffer[:9]))
                if len(self.buffer) < 9 + length:
                    break
                frame.parse_body(memoryview(self.buffer[9:9 + length]))
                self.buffer = self.buffer[9 + length:]
                if isinstance(frame, HeadersFrame):
                    frame.decoded = dict(self.decoder.decode(frame.data))
                frames.append(frame)
        self.sock.close()
        return frames


def test_goaway_frame_with_a_chosen_last_stream_id_lets_lower_streams_finish(fake, vendor_server):
    fake.add_rule({"endpoint": "GET /v1/jobs", "match": {"client_ref": "slow"}, "type": "delay", "params": {"ms": 8000}})
    fake.add_rule({"endpoint": "GET /v1/jobs", "match": {"client_ref": "bye"}, "type": "goaway",
                   "params": {"last_stream_id": 1, "error_code": 2}})
    raw = RawH2(vendor_server)
    first = raw.request("/v1/jobs?client_ref=slow")
    second = raw.request("/v1/jobs?client_ref=bye")
    frames = raw.frames()
    goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert [(g.last_stream_id, g.error_code) for g in goaways] == [(1, 2)]
    after = frames[frames.index(goaways[0]):]
    answered = {f.stream_id: f.decoded[":status"] for f in after if isinstance(f, HeadersFrame)}
    assert answered == {first: "200"}, "stream 1 is at or below last-stream-id: it still gets its answer"
    assert any(isinstance(f, DataFrame) and f.stream_id == first and "END_STREAM" in f.flags for f in after)
    assert not [f for f in frames if f.stream_id == second and isinstance(f, (HeadersFrame, DataFrame))]


def test_a_body_shorter_than_its_content_length_is_a_protocol_error(fake, vendor_server):
    raw = RawH2(vendor_server)
    raw.request("/v1/uploads", method="POST", body=b"12345",
                headers=(("content-type", "application/octet-stream"), ("content-length", "10")))
    goaways = [f for f in raw.frames() if isinstance(f, GoAwayFrame)]
    assert [g.error_code for g in goaways] == [1]  # PROTOCOL_ERROR
    assert fake.invariants()["billed_jobs"] == 0
    with httpx.Client(base_url=vendor_server, headers={"Authorization": f"Bearer {KEY}"}) as h1:
        assert h1.get("/v1/jobs", params={"client_ref": "x"}).status_code == 200



def test_limit_data_over_http2_sends_the_headers_and_n_body_bytes_then_closes(fake, h2):
    up = upload(h2, os.urandom(2000)).json()
    fake.add_rule({"endpoint": "POST /v1/jobs", "type": "limit_data", "params": {"bytes": 40}})
    received = bytearray()
    with pytest.raises(httpx.RemoteProtocolError):
        body = {"upload_id": up["upload_id"], "kind": "transcription", "target_format": "txt", "client_ref": "h2-cut",
                "options": {}}
        with h2.stream("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": "h2-cut"}) as answer:
            assert answer.status_code == 201 and int(answer.headers["content-length"]) > 40
            for chunk in answer.iter_raw():
                received += chunk
    assert len(received) == 40, "exactly the allowed body bytes arrived"
    assert len(ledger(h2, "h2-cut")) == 1, "processed and billed; only the answer was cut"
    cut = fake.journal(endpoint="POST /v1/jobs")[-1]
    assert cut["outcome"] == "limit_data" and cut["protocol"] == "HTTP/2"


def test_malformed_chunk_over_http2_gives_headers_then_a_broken_body(fake, h2):
    fake.add_rule({"endpoint": "GET /v1/usage", "type": "malformed_chunk", "params": {"bytes": 30}})
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        with h2.stream("GET", "/v1/usage") as answer:
            assert answer.status_code == 200
            answer.read()
    assert fake.journal(endpoint="GET /v1/usage")[-1]["outcome"] == "malformed_chunk"
