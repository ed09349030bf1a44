"""Callback URLs in every SSRF form are refused when a task is submitted and again when its
notification is delivered; a delivery connects to the address that was checked (issue 16)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from tasks.models import Notification, Task
from tasks.services.notifications import notification_deliver
from tests.support.flows import submit_file
from tests.unit.test_outbound import REFUSED

pytestmark = pytest.mark.django_db


class Listener:
    """An internal service on loopback that must never hear from Sluice on a tenant's behalf."""

    def __init__(self):
        self.heard: list[dict] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                listener.heard.append({"path": self.path, "host": self.headers.get("Host")})
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    served = Listener()
    yield served
    served.close()


def loopback_forms(port: int) -> list[str]:
    return [f"http://{host}:{port}/hook" for host in (
        "127.0.0.1", "127.1", "2130706433", "0x7f000001", "0177.0.0.1", "0", "0.0.0.0", "localhost", "localhost.",
        "ｌｏｃａｌｈｏｓｔ", "LocalHost", "[::ffff:127.0.0.1]",
    )]


@pytest.mark.parametrize("url", REFUSED)
def test_every_ssrf_form_is_refused_at_submit(api, settings, url):
    assert settings.CALLBACK_ALLOW_PRIVATE is False  # the shipped default
    file_id = api.post("/api/v1/files", data=b"text document", content_type="application/octet-stream").json()["id"]
    answer = api.post("/api/v1/tasks", content_type="application/json", data=json.dumps(
        {"file_id": file_id, "kind": "conversion", "target_format": "txt", "callback_url": url}))
    assert answer.status_code == 400 and answer.json()["code"] == "invalid_request", (url, answer.content)
    assert answer.json()["field"] == "callback_url"
    assert not Task.objects.exists()


def a_notification(api, url: str) -> Notification:
    task = Task.objects.get(pk=submit_file(api))
    return Notification.objects.create(task=task, tenant=task.tenant, url=url, event_type="task.succeeded",
                                       payload={"event": "task.succeeded"}, next_attempt_at=timezone.now())


def test_every_loopback_form_is_refused_at_delivery_and_nothing_is_sent(api, settings, listener):
    # Stored before the rule tightened, or by a name that resolved elsewhere when it was checked.
    for url in loopback_forms(listener.port):
        note = a_notification(api, url)
        notification_deliver(notification_id=note.pk)
        note.refresh_from_db()
        assert note.status != "delivered" and note.last_error == "refused_address", url
    assert listener.heard == []


def test_a_delivery_connects_to_the_address_it_checked_and_names_the_host(api, settings, listener):
    settings.CALLBACK_ALLOW_PRIVATE = True  # the explicit opt-out, so the loopback listener may be called
    note = a_notification(api, f"http://localhost:{listener.port}/hook?tenant=acme")
    notification_deliver(notification_id=note.pk)
    note.refresh_from_db()
    assert note.status == "delivered"
    assert listener.heard == [{"path": "/hook?tenant=acme", "host": f"localhost:{listener.port}"}]
