"""Operators' recovery paths through the console (Django's test client; the browser stories are in
tests/e2e/): selections a bulk action acts on are exactly what its URL says, waiting work can be
found by why it waits and moved, triage groups select their own tasks, the dashboard says when a
vendor is down and links to the work it holds."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from console.staff import staff_ensure
from tasks.lifecycle import task_update, transition
from tasks.models import AuditEntry, ChannelHealth, Task, VendorChannel
from tasks.services.tenancy import tenant_ensure, token_issue
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client):
    user, password = staff_ensure(username="op-recovery", role="operator", actor="test")
    assert client.login(username=user.username, password=password)
    return client


def api_for(name: str) -> Client:
    tenant = tenant_ensure(name=name)
    client = Client()
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {token_issue(tenant=tenant).token}"
    return client


def fail(task_id: str, code: str = "retries_exhausted", channel: str | None = "primary") -> None:
    task = Task.objects.get(pk=task_id)
    transition(task.pk, source=task.state, target="FAILED", generation=task.generation, actor="test",
               reason="test failure", fields={"error_code": code, "error_retryable": True, "channel_id": channel})


def move(task_id: str, target: str, **fields) -> None:
    task = Task.objects.get(pk=task_id)
    assert transition(task.pk, source=task.state, target=target, generation=task.generation, actor="test",
                      reason="test", fields=fields)


def counted(page: str) -> int:
    return int(re.search(r'data-field="count">(\d+)<', page).group(1))


def test_a_second_filter_never_inherits_the_first_selection(operator):
    alpha, beta = api_for("alpha"), api_for("beta")
    for _ in range(3):
        fail(submit_file(alpha))
    for _ in range(2):
        fail(submit_file(beta))
    alpha_id = str(tenant_ensure(name="alpha").pk)
    beta_id = str(tenant_ensure(name="beta").pk)
    # The operator ticks alpha's tasks in the list and picks the bulk action (ids in the URL) ...
    listing = reverse("admin:tasks_task_changelist") + f"?tenant__id__exact={alpha_id}"
    ticked = Task.objects.filter(tenant__name="alpha").values_list("pk", flat=True)
    answer = operator.post(listing, {"action": "bulk_replay", "_selected_action": [str(pk) for pk in ticked]})
    assert answer.status_code == 302 and "ids=" in answer["Location"]
    first = operator.get(answer["Location"]).content.decode()
    assert counted(first) == 3 and "3 chosen tasks" in first
    # ... then previews beta's filter: exactly beta's tasks, said in words.
    second = operator.get(reverse("admin:bulk_preview", args=["replay"]) + f"?tenant__id__exact={beta_id}&state__exact=FAILED")
    page = second.content.decode()
    assert counted(page) == 2
    assert "tasks in state FAILED, of tenant beta" in page
    assert "{'" not in page  # no Python reprs on the page


def test_triage_replays_exactly_its_group(operator, api):
    grouped = [submit_file(api) for _ in range(2)]
    for task_id in grouped:
        fail(task_id, code="", channel=None)
    other = submit_file(api)
    fail(other, code="engine_error", channel="primary")
    triage = operator.get(reverse("admin:triage")).content.decode()
    links = re.findall(r'href="([^"]*bulk/replay/preview/[^"]*)"', triage)
    assert len(links) == 2
    counts = sorted(counted(operator.get(link.replace("&amp;", "&")).content.decode()) for link in links)
    assert counts == [1, 2]


def test_waiting_work_is_found_by_its_reason_and_moved_to_another_channel(operator, api):
    from tasks.models import Lane

    VendorChannel.objects.filter(name="fallback").update(enabled=True)
    Lane.objects.filter(pk="interactive").update(paused=True)  # nothing dispatches while the operator looks
    queued = [submit_file(api) for _ in range(3)]
    for task_id in queued:
        move(task_id, "QUEUED", channel_id="primary", lane_id="interactive")
    waiting = submit_file(api)
    move(waiting, "QUEUED", channel_id="primary", lane_id="interactive")
    move(waiting, "RETRY_WAIT", waiting_reason="rate_limited")
    ChannelHealth.objects.update_or_create(channel_id="primary", defaults={"breaker_state": "OPEN"})

    listing = operator.get(reverse("admin:tasks_task_changelist") + "?waiting=rate_limited").content.decode()
    assert waiting[:8] in listing and not any(t[:8] in listing for t in queued)
    assert "sluice-waiting-code" in listing
    assert operator.get(reverse("admin:tasks_task_changelist") + "?waiting=nonsense").status_code == 400

    # Dispatched work does not move (it may hold a vendor operation).
    assert task_update(queued[0], state="QUEUED", generation=1, dispatched_at=Task.objects.get(pk=queued[0]).created_at)
    url = reverse("admin:bulk_preview", args=["move_channel"]) + "?held_by=primary"
    choose = operator.get(url).content.decode()
    assert 'name="to"' in choose and counted(choose) == 0
    preview = operator.get(url + "&to=fallback").content.decode()
    assert counted(preview) == 2
    assert "only queued tasks not yet dispatched move (RETRY_WAIT)" in preview
    from django_q.conf import Conf

    Conf.SYNC, before = True, Conf.SYNC
    try:
        answer = operator.post(url + "&to=fallback", {})
    finally:
        Conf.SYNC = before
    assert answer.status_code == 302
    assert sorted(Task.objects.filter(pk__in=queued).values_list("channel_id", flat=True)) == ["fallback", "fallback", "primary"]
    entry = AuditEntry.objects.get(action="bulk_move_channel")
    assert entry.done == 2 and entry.filter == {"held_by": "primary"}


def test_the_dashboard_says_a_vendor_is_down_and_links_to_the_work_it_holds(operator, api):
    task_id = submit_file(api)
    move(task_id, "QUEUED", channel_id="primary", lane_id="interactive")
    move(task_id, "RETRY_WAIT", waiting_reason="breaker_open")
    assert "data-outage" not in operator.get(reverse("admin:index")).content.decode()
    ChannelHealth.objects.update_or_create(channel_id="primary", defaults={"breaker_state": "OPEN"})
    page = operator.get(reverse("admin:index")).content.decode()
    assert 'data-outage="primary"' in page and "1 task(s) wait on it" in page
    link = re.search(r'href="([^"]+)" data-action="outage-tasks"', page).group(1)
    listing = operator.get(link).content.decode()
    assert task_id[:8] in listing and "Retry now all 1 matching" in listing


def test_search_finds_tasks_by_file_name_tenant_and_parameters(operator, api):
    wanted = submit_file(api, name="board-meeting.wav", params={"language": "de"})
    other = submit_file(api, name="other.wav")
    for term, hit in (("board-meeting", True), ("acme", True), ('"de"', True), ("nothing-like-it", False)):
        page = operator.get(reverse("admin:tasks_task_changelist"), {"q": term}).content.decode()
        assert (wanted[:8] in page) is hit, term
    page = operator.get(reverse("admin:tasks_task_changelist"), {"q": "board-meeting"}).content.decode()
    assert other[:8] not in page


def test_the_task_list_is_newest_first_and_billings_drill_down_opens(operator, api):
    first, second = submit_file(api), submit_file(api)
    page = operator.get(reverse("admin:tasks_task_changelist")).content.decode()
    assert page.index(second[:8]) < page.index(first[:8])
    ids = operator.get(reverse("admin:tasks_task_changelist"), {"ids": first}).content.decode()
    assert first[:8] in ids and second[:8] not in ids
    assert operator.get(reverse("admin:tasks_task_changelist"), {"ids": "garbage"}).status_code == 400


def test_pausing_a_lane_asks_first_and_resume_undoes_it(client):
    from tasks.models import Lane

    user, password = staff_ensure(username="admin-recovery", role="admin", actor="test")
    client.login(username=user.username, password=password)
    url = reverse("admin:tasks_lane_changelist")
    asked = client.post(url, {"action": "pause", "_selected_action": ["batch"]})
    assert asked.status_code == 200 and "No new work starts" in asked.content.decode()
    assert not Lane.objects.get(pk="batch").paused
    client.post(url, {"action": "pause", "_selected_action": ["batch"], "confirmed": "yes"})
    assert Lane.objects.get(pk="batch").paused
    listing = client.get(url).content.decode()
    assert 'data-lane-state="paused"' in listing
    client.post(url, {"action": "resume", "_selected_action": ["batch"]})
    assert not Lane.objects.get(pk="batch").paused
    assert AuditEntry.objects.filter(action="lane_change").count() == 2


def test_irreversible_buttons_say_what_they_do_before_they_do_it(operator, api):
    task_id = submit_file(api)
    page = operator.get(reverse("admin:tasks_task_change", args=[task_id])).content.decode()
    assert re.search(r'data-action="cancel" data-confirm="Cancel this task\?', page)


def test_a_refused_fault_rule_keeps_what_was_typed(client, vendor, settings):
    settings.FAKEVENDOR_URL = vendor.url
    user, password = staff_ensure(username="qa-recovery", role="qa", actor="test")
    client.login(username=user.username, password=password)
    typed = '{"endpoint": "POST /v1/jobs", "type": "no_such_fault"}'
    answer = client.post(reverse("admin:fakevendor"), {"op": "add", "rule": typed}, follow=True)
    page = answer.content.decode()
    assert "Refused" in page and "no_such_fault" in page.split("<textarea")[1].split("</textarea>")[0]
    assert AuditEntry.objects.filter(action="fakevendor_add", skipped=1).exists()
    settings.FAKEVENDOR_URL = "http://127.0.0.1:9"  # nothing listens: said on the page, not a 500
    answer = client.post(reverse("admin:fakevendor"), {"op": "clear"}, follow=True)
    assert answer.status_code == 200 and "did not answer" in answer.content.decode()


def test_a_poc_run_from_the_console_can_drive_the_live_system(client, monkeypatch):
    from console.models import PocRun

    monkeypatch.setattr("tasks.queueing.send", lambda *a, **k: None)  # started in the background elsewhere
    user, password = staff_ensure(username="qa-live", role="qa", actor="test")
    client.login(username=user.username, password=password)
    refused = client.post(reverse("admin:poc_list"), {"scenario": "timeout-cancel-worker-lost", "live": "yes"}, follow=True)
    assert "cannot run against the live system" in refused.content.decode() and PocRun.objects.count() == 0
    client.post(reverse("admin:poc_list"), {"scenario": "rate-limit-storm", "live": "yes"})
    run = PocRun.objects.get()
    assert run.live
    from console import poc_jobs

    commands = []
    monkeypatch.setattr(poc_jobs.subprocess, "Popen", lambda command, **kw: commands.append(command) or _Done())
    poc_jobs.run_poc(run.pk)
    assert "--live" in commands[0]


class _Done:
    class stderr:  # noqa: N801 - the shape of Popen's attribute
        @staticmethod
        def read1(n):
            return b""

    returncode = 0

    def wait(self):
        return 0


def test_every_fault_type_has_a_form_whose_example_the_fake_vendor_accepts(client, vendor, settings):
    from fakevendor.faults import PARAMETERS, TYPES

    settings.FAKEVENDOR_URL = vendor.url
    user, password = staff_ensure(username="qa-forms", role="qa", actor="test")
    client.login(username=user.username, password=password)
    page = client.get(reverse("admin:fakevendor")).content.decode()
    assert sorted(re.findall(r'data-fault-type="([a-z_0-9]+)"', page)) == sorted(TYPES)
    for kind, params in PARAMETERS.items():
        form = {"op": "add_form", "type": kind, "endpoint": "GET /v1/usage", "times": "1"}
        form.update({f"param_{p.name}": str(p.example) for p in params if p.example is not None})
        answer = client.post(reverse("admin:fakevendor"), form, follow=True)
        assert "Refused" not in answer.content.decode(), (kind, form)
    assert len(vendor.control.rules()) == len(TYPES)
    bad = client.post(reverse("admin:fakevendor"), {"op": "add_form", "type": "dribble", "param_chunks": "many"},
                      follow=True).content.decode()
    assert "params.chunks: must be an integer" in bad
