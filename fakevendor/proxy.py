"""Proxy, record and playback: the fault engine in front of a real vendor.

- proxy (`--upstream URL`): every vendor request is forwarded to the upstream (any dialect, any
  path; the client's credentials go with it) and its answer comes back through the same rules:
  a `response_lost` rule loses a real vendor's answer after it did the work, a `delay` slows it.
- record (`--upstream URL --record FILE`): the same, and every exchange is appended to FILE (JSON
  lines: method, target, the request body's digest, status, headers, body).
- playback (`--playback FILE`): no upstream; each request is answered with the recorded answers
  to the same method and target, in their recorded order (the last one repeats), 404
  `not_recorded` otherwise.

Bodies go through temporary files, so memory stays flat whatever the size. Create- and job-level
faults need the vendor's own state and do not apply here; every wire fault does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fakevendor.answers import Answer, problem

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "content-length", "date", "host", "set-cookie"}
SPOOL_BYTES = 1024 * 1024
RECORDED_BODY_BYTES = 64 * 1024 * 1024


class ProxyConfigError(ValueError):
    pass


def check_upstream(url: str) -> str:
    """An upstream base URL, validated: http(s), a host, no credentials, query or fragment."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProxyConfigError(f"--upstream must be an http:// or https:// URL with a host, not {url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ProxyConfigError("--upstream takes no credentials, query or fragment (clients send their own keys)")
    return url.rstrip("/")


class Upstream:
    """The backend of a vendor request in proxy, record or playback mode."""

    def __init__(self, *, url: str = "", record: str = "", playback: str = "", spool_dir: Path) -> None:
        self.url = url
        self.record_path = Path(record) if record else None
        self.spool_dir = spool_dir
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._client = None
        self._lock = threading.Lock()
        self.recorded: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._served: dict[tuple[str, str], int] = {}
        if playback:
            self._load(Path(playback))

    @classmethod
    def configured(cls, config: Any) -> Upstream | None:
        if not (config.upstream or config.playback):
            return None
        return cls(url=config.upstream, record=config.record, playback=config.playback,
                   spool_dir=Path(config.data_dir) / "proxy")

    @property
    def mode(self) -> str:
        return "playback" if not self.url else "record" if self.record_path else "proxy"

    def _load(self, path: Path) -> None:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ProxyConfigError(f"cannot read the recording {path}: {exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key = (item["method"], item["target"])
            except (ValueError, KeyError, TypeError):
                raise ProxyConfigError(f"{path}:{number}: not a recorded exchange") from None
            self.recorded.setdefault(key, []).append(item)

    # --- the backend surface (as the dialects have it) --------------------------------------------
    async def route(self, conn: Any, request: Any, channel: Any, facts: Any, *, bandwidth: float | None,
                    reset_after: int | None) -> Answer:
        if not request.target.startswith("/") or request.target.startswith("//"):
            # Only origin-form targets: nothing a client sends may point the proxy at another host.
            if conn.body_pending:
                await conn.read_body(request)
            return problem(400, "invalid_target", "The request target must be a path (origin-form).")
        spooled = await self._spool_request(conn, request, bandwidth=bandwidth, reset_after=reset_after)
        try:
            if not self.url:
                return self._playback(request)
            return await self._forward(request, spooled)
        finally:
            spooled.close()

    async def _spool_request(self, conn: Any, request: Any, *, bandwidth, reset_after) -> Any:
        spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, dir=self.spool_dir)
        digest = hashlib.sha256()
        if request.body:
            spooled.write(request.body)
            digest.update(request.body)
        elif conn.body_pending:
            def sink(chunk: bytes) -> None:
                digest.update(chunk)
                spooled.write(chunk)

            await conn.read_body(request, sink=sink, bytes_per_s=bandwidth, reset_after=reset_after)
        if request.bytes_in or request.body:
            request.input_sha256 = request.input_sha256 or digest.hexdigest()
        spooled.seek(0)
        return spooled

    async def _forward(self, request: Any, spooled: Any) -> Answer:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0), follow_redirects=False,
                                             trust_env=False)
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
        size_in = spooled.seek(0, 2)
        spooled.seek(0)
        if size_in or request.method in ("POST", "PUT", "PATCH"):
            headers.append(("content-length", str(size_in)))

        async def body():
            while chunk := spooled.read(64 * 1024):
                yield chunk

        has_body = size_in > 0
        path = self.spool_dir / f"answer-{uuid.uuid4().hex}"
        request.cleanup.append(path)  # removed once answered, whatever happens
        try:
            async with self._client.stream(request.method, self.url + request.target, headers=headers,
                                           content=body() if has_body else None) as answer:
                size = 0
                with open(path, "wb") as out:
                    async for chunk in answer.aiter_raw():
                        out.write(chunk)
                        size += len(chunk)
                status = answer.status_code
                kept = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in HOP_BY_HOP]
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return problem(502, "upstream_unreachable", f"The upstream vendor did not answer: {type(exc).__name__}.",
                           retryable=True)
        if size <= SPOOL_BYTES:
            data = path.read_bytes()
            result: bytes | Path = data
        else:
            result = path
        if self.record_path is not None:
            self._record(request, status, kept, path, size)
        return status, kept, result

    def _record(self, request: Any, status: int, headers: list[tuple[str, str]], path: Path, size: int) -> None:
        item = {"method": request.method, "target": request.target, "request_sha256": request.input_sha256,
                "status": status, "headers": headers}
        if size <= RECORDED_BODY_BYTES:
            item["body_b64"] = base64.b64encode(path.read_bytes()).decode()
        else:
            item["body_omitted_bytes"] = size
        with self._lock, open(self.record_path, "a") as out:
            out.write(json.dumps(item) + "\n")

    def _playback(self, request: Any) -> Answer:
        key = (request.method, request.target)
        answers = self.recorded.get(key)
        if not answers:
            return problem(404, "not_recorded", f"Nothing was recorded for {request.method} {request.target}.")
        index = self._served.get(key, 0)
        self._served[key] = index + 1
        item = answers[min(index, len(answers) - 1)]
        body = base64.b64decode(item.get("body_b64") or "")
        return item["status"], [tuple(h) for h in item["headers"]], body
