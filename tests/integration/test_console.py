"""The operator console through Django's test client: every page renders for every role, actions a
role may not take are neither shown nor accepted, and every action is audited."""

import pytest
from django.urls import reverse

from console.staff import staff_ensure
from tasks.models import AuditEntry, Lane, Task
from tests.support.flows import route, submit_file

pytestmark = pytest.mark.django_db


@pytest.fixture
def as_role(client):
    def login(role: str):
        user, password = staff_ensure(username=f"{role}-user", role=role, actor="test")
        assert client.login(username=user.username, password=password)
        return client

    return login


PAGES = ["admin:index", "admin:dashboard_fragment", "admin:tasks_task_changelist", "admin:triage", "admin:billing",
         "admin:poc_list", "admin:tasks_lane_changelist", "admin:tasks_vendorchannel_changelist",
         "admin:tasks_tenant_changelist", "admin:tasks_auditentry_changelist", "admin:tasks_duplicateincident_changelist"]


@pytest.mark.parametrize("role", ["viewer", "operator", "qa", "admin"])
def test_every_page_renders_for_every_role(as_role, api, role):
    submit_file(api)
    client = as_role(role)
    for name in PAGES:
        answer = client.get(reverse(name))
        assert answer.status_code == 200, (name, answer.status_code)
    task = Task.objects.get()
    page = client.get(reverse("admin:tasks_task_change", args=[task.pk])).content.decode()
    assert "Timeline" in page and "Pre-check findings" in page


def test_a_viewer_sees_no_action_and_a_forged_post_is_refused(as_role, api):
    task = Task.objects.get(pk=submit_file(api))
    client = as_role("viewer")
    page = client.get(reverse("admin:tasks_task_change", args=[task.pk])).content.decode()
    assert 'data-action="cancel"' not in page
    answer = client.post(reverse("admin:task_action", args=[task.pk, "cancel"]))
    assert answer.status_code == 403
    assert Task.objects.get(pk=task.pk).state == "ACCEPTED"
    assert client.post(reverse("admin:channel_force", args=["primary"]), {"state": "FORCED_OPEN"}).status_code == 403
    assert client.post(reverse("admin:poc_list"), {"scenario": "all"}).status_code == 403
    listing = client.get(reverse("admin:tasks_task_changelist")).content.decode()
    assert "sluice-bulk" not in listing


def test_an_operator_cancels_from_the_task_page_and_the_audit_log_says_so(as_role, api):
    task = Task.objects.get(pk=submit_file(api))
    client = as_role("operator")
    page = client.get(reverse("admin:tasks_task_change", args=[task.pk])).content.decode()
    assert 'data-action="cancel"' in page
    client.post(reverse("admin:task_action", args=[task.pk, "cancel"]))
    assert Task.objects.get(pk=task.pk).state == "CANCELLED"
    entry = AuditEntry.objects.get(action="task_cancel")
    assert entry.actor == "operator-user" and entry.target_id == str(task.pk) and entry.done == 1


def test_only_admins_edit_lanes_and_quotas(as_role):
    operator = as_role("operator")
    url = reverse("admin:tasks_lane_change", args=["batch"])
    assert operator.post(url, {"max_running": 1}).status_code == 403
    admin = as_role("admin")
    form = admin.get(url)
    assert form.status_code == 200
    data = {f: getattr(Lane.objects.get(pk="batch"), f) for f in (
        "name", "max_running", "max_queued", "queue_deadline_s", "execution_timeout_s", "overflow_policy",
        "early_close_pct", "aging_s", "dispatch_order", "urgency_s", "busy_close_pct", "oldest_wait_limit_s")}
    data.update(max_running=3)
    answer = admin.post(url, data)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert Lane.objects.get(pk="batch").max_running == 3
    assert AuditEntry.objects.filter(action="lane_change", actor="admin-user").exists()


def failed_tasks(api, n: int) -> list[str]:
    from tasks.lifecycle import transition

    ids = []
    for _ in range(n):
        task = Task.objects.get(pk=submit_file(api))
        transition(task.pk, source="ACCEPTED", target="FAILED", generation=task.generation, actor="test",
                   reason="vendor outage", fields={"error_code": "retries_exhausted", "error_retryable": True})
        ids.append(str(task.pk))
    return ids


def test_bulk_replay_applies_to_everything_matching_the_filter_after_a_preview(as_role, api, monkeypatch):
    from django_q.conf import Conf

    from console.models import BulkOperation

    monkeypatch.setattr(Conf, "SYNC", True)
    ids = failed_tasks(api, 14)
    client = as_role("operator")
    url = reverse("admin:bulk_preview", args=["replay"]) + "?state__exact=FAILED"
    preview = client.get(url).content.decode()
    assert 'data-field="count">14<' in preview and 'name="confirm"' in preview
    refused = client.post(url, {})
    assert BulkOperation.objects.count() == 0 and "Tick the box" in refused.content.decode()
    answer = client.post(url, {"confirm": "yes"})
    op = BulkOperation.objects.get()
    assert answer.status_code == 302 and answer["Location"] == reverse("admin:bulk_progress", args=[op.pk])
    op.refresh_from_db()
    assert op.status == "done" and op.done == 14 and op.skipped == 0
    assert set(Task.objects.filter(pk__in=ids).values_list("state", flat=True)) == {"QUEUED"}
    audit = AuditEntry.objects.get(action="bulk_replay")
    assert audit.filter == {"state__exact": "FAILED"} and audit.done == 14
    status = client.get(reverse("admin:bulk_status", args=[op.pk])).json()
    assert status["progress_pct"] == 100


def test_large_bulk_operations_need_the_count_typed(as_role, api):
    from console.bulk import confirmation_for

    assert confirmation_for(5) == "button" and confirmation_for(50) == "check" and confirmation_for(500) == "type"


def test_preview_explains_what_will_be_skipped(as_role, api):
    failed_tasks(api, 2)
    submit_file(api)  # an ACCEPTED task the replay must skip
    client = as_role("operator")
    assert client.get(reverse("admin:bulk_preview", args=["replay"])).status_code == 302  # no filter: choose first
    page = client.get(reverse("admin:bulk_preview", args=["replay"]) + "?q=").content.decode()
    assert "it is ACCEPTED, not FAILED or EXPIRED" in page and 'data-field="count">2<' in page


def test_qa_sets_a_fault_rule_from_the_console_and_sees_its_effect_in_the_journal(as_role, vendor, settings):
    import httpx

    settings.FAKEVENDOR_URL = vendor.url
    client = as_role("qa")
    rule = '{"id": "console-rule", "endpoint": "GET /v1/usage", "type": "http_error", "params": {"status": 502}}'
    client.post(reverse("admin:fakevendor"), {"op": "add", "rule": rule})
    assert [r["id"] for r in vendor.control.rules()] == ["console-rule"]
    httpx.get(f"{vendor.url}/primary/v1/usage", headers={"Authorization": "Bearer dev-vendor-key"})
    page = client.get(reverse("admin:fakevendor")).content.decode()
    assert "console-rule" in page and "502" in page
    # The journal, found by rule and counted, with each exchange's headers and bodies (redacted).
    httpx.get(f"{vendor.url}/primary/v1/jobs/job_x", headers={"Authorization": "Bearer dev-vendor-key"})
    found = client.get(reverse("admin:fakevendor") + "?rule=console-rule").content.decode()
    assert 'id="journal-count"><strong>1</strong>' in found and "<code>502</code> 1" in found
    assert "authorization: [redacted]" in found and "dev-vendor-key" not in found
    assert "GET /primary/v1/usage" in found and "/v1/jobs/job_x" not in found
    bad = client.get(reverse("admin:fakevendor") + "?status=teapot").content.decode()
    assert "Journal filter refused" in bad and "field: status" in bad
    refused = client.post(reverse("admin:fakevendor"), {"op": "add", "rule": '{"endpoint": "GET /v1/usage", "type": "nope"}'},
                          follow=True).content.decode()
    assert "field: type" in refused
    viewer = as_role("viewer")
    assert viewer.post(reverse("admin:fakevendor"), {"op": "clear"}).status_code == 403


def test_only_the_admin_role_opens_quarantined_content_and_it_is_audited(as_role, vendor, api):
    from tasks.models import Quarantine
    from tasks.poc import files

    route(submit_file(api, files.truncated_pdf(), name="secret-contract.pdf", kind="conversion", target="txt"))
    entry = Quarantine.objects.get()
    url = reverse("admin:quarantine_download", args=[entry.pk])
    assert as_role("operator").get(url).status_code == 403
    answer = as_role("admin").get(url)
    assert answer.status_code == 200 and answer["Content-Type"] == "application/octet-stream"
    assert "secret-contract" not in answer["Content-Disposition"] and answer["X-Content-Type-Options"] == "nosniff"
    assert AuditEntry.objects.filter(action="quarantine_open_file", actor="admin-user").exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_qa_runs_a_scenario_from_the_console_and_downloads_its_report(as_role, monkeypatch):
    from django_q.conf import Conf

    from console.models import PocRun

    monkeypatch.setattr(Conf, "SYNC", True)  # the background job runs here; it starts its own system
    client = as_role("qa")
    answer = client.post(reverse("admin:poc_list"), {"scenario": "corrupt-file", "seed": "3", "tasks": "6"})
    run = PocRun.objects.get()
    assert answer.status_code == 302 and answer["Location"] == reverse("admin:poc_detail", args=[run.pk])
    run.refresh_from_db()
    assert run.status == "passed", run.report
    page = client.get(reverse("admin:poc_detail", args=[run.pk])).content.decode()
    assert "quarantined_with_right_reason" in page
    report = client.get(reverse("admin:poc_detail", args=[run.pk]) + "?format=json").json()
    assert report["scenario"] == "corrupt-file" and report["passed"] is True
    assert AuditEntry.objects.filter(action="poc_run", actor="qa-user").exists()
