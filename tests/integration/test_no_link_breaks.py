"""No page of the console or the portal answers 500 for any link it renders: a crawler follows every
link (GET only) from the start pages, as each role, over a database holding tasks in every state,
a quarantined file, a dead letter and a bulk operation."""

from __future__ import annotations

import re
from collections import deque
from html import unescape
from urllib.parse import urljoin, urlsplit

import pytest

from console.staff import staff_ensure
from tasks.lifecycle import transition
from tasks.models import DeadLetter, Task
from tasks.poc import files
from tasks.services.tenancy import tenant_user_ensure
from tests.support.flows import route, submit_file

pytestmark = pytest.mark.django_db

LINK = re.compile(r'href="([^"#]+)"')
SKIP = ("/logout", "/static/", "download", "/result", "format=json", "openapi")


def crawl(client, start: str, *, prefix: str, limit: int = 400) -> dict[str, int]:
    seen: dict[str, int] = {}
    queue = deque([start])
    while queue and len(seen) < limit:
        url = queue.popleft()
        if url in seen:
            continue
        answer = client.get(url)
        seen[url] = answer.status_code
        if answer.status_code != 200 or "text/html" not in answer.get("Content-Type", ""):
            continue
        for href in LINK.findall(answer.content.decode()):
            target = urljoin(url, unescape(href))
            parts = urlsplit(target)
            if parts.netloc and parts.netloc != "testserver":
                continue
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            if path.startswith(prefix) and not any(s in path for s in SKIP) and path not in seen:
                queue.append(path)
    return seen


@pytest.fixture
def history(api, vendor):
    ids = [submit_file(api, name=f"file-{n}.wav") for n in range(4)]
    task = Task.objects.get(pk=ids[0])
    transition(task.pk, source="ACCEPTED", target="FAILED", generation=0, actor="test", reason="failed",
               fields={"error_code": "retries_exhausted", "channel_id": "primary"})
    DeadLetter.objects.create(task=task, tenant=task.tenant, error_class="VendorError", error_code="retries_exhausted",
                              attempts=3)
    task = Task.objects.get(pk=ids[1])
    moved = transition(task.pk, source="ACCEPTED", target="QUEUED", generation=0, actor="test", reason="routed",
                       fields={"channel_id": "primary", "lane_id": "interactive"})
    transition(task.pk, source="QUEUED", target="RETRY_WAIT", generation=moved.generation, actor="test",
               reason="429", fields={"waiting_reason": "rate_limited"})
    route(submit_file(api, files.truncated_pdf(), name="broken.pdf", kind="conversion", target="txt"))
    return ids


@pytest.mark.parametrize("role", ["viewer", "operator", "admin"])
def test_every_console_link_answers_without_a_server_error(client, history, role):
    user, password = staff_ensure(username=f"{role}-crawler", role=role, actor="test")
    assert client.login(username=user.username, password=password)
    seen = crawl(client, "/console/", prefix="/console/")
    broken = {url: status for url, status in seen.items() if status >= 500}
    assert not broken, broken
    assert len(seen) > 30  # it did crawl


def test_every_portal_link_answers_without_a_server_error(client, history, tenant):
    user, password = tenant_user_ensure(username="crawler", tenant=tenant)
    assert client.login(username="crawler", password=password)
    seen = crawl(client, "/tasks/", prefix="/tasks")
    assert not {url: status for url, status in seen.items() if status >= 500}
    assert len(seen) >= 5
