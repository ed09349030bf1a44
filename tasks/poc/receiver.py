"""A business system's notification endpoint for scenarios: acknowledges, fails, or fails a few
times; records every delivery by event id and checks each signature."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, secrets_by_tenant: dict[str, str] | None = None) -> None:
        self.deliveries: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.bad_signatures = 0
        self.secrets = secrets_by_tenant or {}
        self.fail_first: dict[str, int] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                mode = self.path.strip("/").split("/")[0]
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = receiver.handle(mode, body, self.headers.get("X-Sluice-Signature", ""))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self._lock = threading.Lock()

    def url(self, mode: str) -> str:
        """`ack` acknowledges, `fail` always fails (500), `flaky` fails twice then acknowledges."""
        return f"http://127.0.0.1:{self.server.server_port}/{mode}"

    def handle(self, mode: str, body: bytes, signature: str) -> int:
        try:
            event = json.loads(body)
        except ValueError:
            return 400
        if self.secrets and not any(
            hmac.compare_digest(signature, "sha256=" + hmac.new(s.encode(), body, hashlib.sha256).hexdigest())
            for s in self.secrets.values()
        ):
            with self._lock:
                self.bad_signatures += 1
            return 401
        event_id = event.get("event_id", "")
        with self._lock:
            attempts = self.fail_first.get(event_id, 0)
            if mode == "fail" or (mode == "flaky" and attempts < 2):
                self.fail_first[event_id] = attempts + 1
                self.deliveries[event_id].append({"acknowledged": False, "event": event})
                return 500
            self.deliveries[event_id].append({"acknowledged": True, "event": event})
        return 204

    def acknowledged(self) -> dict[str, int]:
        return {k: sum(1 for d in v if d["acknowledged"]) for k, v in self.deliveries.items()}

    def attempts_for_task(self, task_id: str) -> int:
        return sum(len(v) for v in self.deliveries.values() if v and v[0]["event"]["task"]["id"] == task_id)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
