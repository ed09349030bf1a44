"""The console in a real browser: roles, charts, a bulk replay with preview and progress, a quota
edit, and an operator who finds and retries the tasks hurt by a vendor outage."""

from __future__ import annotations

import re

import pytest

from console.staff import staff_ensure
from tasks.lifecycle import transition
from tasks.models import AuditEntry, Task, TenantQuota
from tests.conftest import TEST_TIME_SCALE, wait_for
from tests.e2e.conftest import screenshot
from tests.support.flows import submit_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]


def staff(role: str) -> tuple[str, str]:
    user, password = staff_ensure(username=f"{role}-ui", role=role, actor="test")
    return user.username, password


@pytest.mark.parametrize("role,sees,hidden", [
    ("viewer", ["Dashboard", "Tasks", "Billing"], ["Quarantine", "Dead letters"]),
    ("operator", ["Quarantine", "Dead letters", "Triage"], []),
    ("qa", ["POC", "Fake vendor"], ["Quarantine"]),
    ("admin", ["Tenants", "Lanes", "Channels", "Audit"], []),
])
def test_each_role_logs_in_and_sees_its_console(page, login, live_server, role, sees, hidden):
    login(*staff(role))
    nav = page.locator("nav.sluice-nav").inner_text()
    for label in sees:
        assert label in nav, (role, label)
    for label in hidden:
        assert label not in nav, (role, label)
    assert page.locator(f'[data-role="{role}"]').count() == 1
    screenshot(page, f"dashboard-{role}")


def test_the_dashboard_renders_its_charts_and_refreshes_without_a_reload(page, login, live_server, api):
    for _ in range(3):
        submit_file(api)
    login(*staff("viewer"))
    assert page.locator("svg.bars").count() >= 2 and page.locator("svg.meter").count() >= 4
    assert page.locator("svg.spark").count() >= 4
    stamp = page.locator("#dashboard-updated").inner_text()
    page.wait_for_function("s => document.querySelector('#dashboard-updated').innerText !== s", arg=stamp, timeout=15_000)
    assert page.url.endswith("/console/")
    page.emulate_media(color_scheme="dark")
    screenshot(page, "dashboard-dark")


def test_a_viewer_sees_no_action_buttons_and_a_forged_post_is_refused(page, login, live_server, api):
    task_id = submit_file(api)
    login(*staff("viewer"))
    page.goto(f"{live_server.url}/console/tasks/task/{task_id}/change/")
    assert page.locator("text=Timeline").count() == 1
    assert page.locator("[data-action]").count() == 0
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    forged = page.request.post(f"{live_server.url}/console/task/{task_id}/cancel/",
                               headers={"X-CSRFToken": token, "Referer": live_server.url + "/console/"})
    assert forged.status == 403
    assert Task.objects.get(pk=task_id).state == "ACCEPTED"
    screenshot(page, "task-viewer")


def test_an_admin_edits_a_tenant_quota(page, login, live_server, tenant):
    login(*staff("admin"))
    page.goto(f"{live_server.url}/console/tasks/tenant/{tenant.pk}/change/")
    page.fill("input[name='quota-0-max_running']", "7")
    page.fill("input[name='quota-0-submissions_per_minute']", "120")
    screenshot(page, "quota-edit")
    page.click("input[name=_save]")
    page.wait_for_load_state()
    quota = TenantQuota.objects.get(tenant=tenant)
    assert quota.max_running == 7 and quota.submissions_per_minute == 120
    assert AuditEntry.objects.filter(action="tenant_change", actor="admin-ui").exists()


@pytest.fixture
def control_cluster(tmp_path, transactional_db):
    """A real control cluster: bulk operations run in the background as in production."""
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "cluster", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    stack.start_cluster(None, workers=1)
    yield stack
    stack.stop_all()


def test_a_bulk_replay_with_preview_progress_and_an_audit_entry(page, login, live_server, api, control_cluster):
    ids = []
    for _ in range(12):
        task = Task.objects.get(pk=submit_file(api))
        transition(task.pk, source="ACCEPTED", target="FAILED", generation=0, actor="test", reason="vendor outage",
                   fields={"error_code": "retries_exhausted", "error_retryable": True})
        ids.append(str(task.pk))
    login(*staff("operator"))
    page.goto(f"{live_server.url}/console/tasks/task/?state__exact=FAILED")
    assert "12 tasks" in page.locator("#changelist").inner_text() or "12" in page.locator(".paginator").inner_text()
    page.click("a.sluice-bulk:has-text('Replay all 12 matching')")
    page.wait_for_selector("[data-field=count]")
    assert page.locator("[data-field=count]").inner_text() == "12"
    screenshot(page, "bulk-preview")
    page.check("input[name=confirm]")
    page.click("button:has-text('Run in the background')")
    page.wait_for_url(re.compile(r".*/console/bulk/\d+/$"))
    page.wait_for_function("() => document.querySelector('[data-field=status]').innerText === 'done'", timeout=60_000)
    assert page.locator("[data-field=done]").inner_text() == "12"
    screenshot(page, "bulk-progress")
    assert set(Task.objects.filter(pk__in=ids).values_list("state", flat=True)) <= {"QUEUED", "ACCEPTED", "RUNNING", "SUCCEEDED"}
    page.goto(f"{live_server.url}/console/tasks/auditentry/")
    assert page.locator("text=bulk_replay").count() >= 1
    screenshot(page, "audit-log")


def test_an_operator_finds_the_tasks_hurt_by_an_outage_sees_why_they_wait_and_retries_them_all(
        page, login, live_server, api, vendor, tmp_path):
    """From the dashboard, in a real browser, against a real system whose vendor is down."""
    from tasks.models import VendorChannel
    from tasks.system import Stack

    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    VendorChannel.objects.filter(name="primary").update(retry_after_cap_s=10_000, max_attempts=50, breaker_minimum_calls=1000)
    # The vendor is down and asks for an hour: the tasks wait, visibly, until someone acts.
    outage = vendor.control.add_rule({"endpoint": "* *", "type": "rate_limit",
                                      "params": {"status": 503, "retry_after_s": 3600}})
    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05"})
    try:
        stack.start_dispatcher()
        stack.start_cluster(None, workers=1)
        stack.start_cluster("interactive", workers=2)
        ids = [submit_file(api) for _ in range(5)]
        wait_for(lambda: Task.objects.filter(pk__in=ids, state="RETRY_WAIT").count() == 5, timeout=60,
                 message="the outage to push every task into RETRY_WAIT")
        login(*staff("operator"))
        screenshot(page, "outage-dashboard")
        page.click("nav.sluice-nav >> text=Tasks")
        page.click("#changelist-filter >> text=RETRY_WAIT")
        page.wait_for_url(re.compile(r".*state__exact=RETRY_WAIT.*"))
        page.wait_for_selector("#result_list")
        assert page.locator("#result_list tbody tr").count() == 5
        page.locator("#result_list tbody tr td a").first.click()
        page.wait_for_selector(".sluice-waiting")
        assert page.locator(".sluice-waiting").inner_text() == "waiting: retry_backoff"
        assert page.locator("#timeline").inner_text().count("unavailable") >= 1
        screenshot(page, "outage-task")
        vendor.control.delete_rule(outage["id"])
        page.go_back()
        page.wait_for_selector("a.sluice-bulk")
        screenshot(page, "outage-list")
        page.click("a.sluice-bulk:has-text('Retry now all 5 matching')")
        page.wait_for_selector("[data-field=count]")
        assert page.locator("[data-field=count]").inner_text() == "5"
        page.click("button:has-text('Run in the background')")
        page.wait_for_function("() => document.querySelector('[data-field=status]').innerText === 'done'", timeout=60_000)
        wait_for(lambda: Task.objects.filter(pk__in=ids, state="SUCCEEDED").count() == 5, timeout=60,
                 message="every retried task to succeed")
        page.goto(f"{live_server.url}/console/tasks/auditentry/")
        assert page.locator("text=bulk_retry_now").count() >= 1
        screenshot(page, "outage-audit")
    finally:
        stack.stop_all()


def test_the_console_fits_a_laptop_and_reads_on_a_phone(page, login, live_server, api):
    for _ in range(3):
        submit_file(api, name="quarterly-review-with-a-long-name.wav")
    login(*staff("admin"))
    page.set_viewport_size({"width": 1280, "height": 900})
    for path in ("/console/", "/console/tasks/task/"):
        page.goto(live_server.url + path)
        nav = page.locator("nav.sluice-nav").bounding_box()
        line = page.locator("nav.sluice-nav a").first.bounding_box()
        assert nav["height"] < 2 * line["height"] + 4, (path, nav, line)  # one line: the header does not wrap
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), path
    results = page.locator("#changelist .results")
    assert page.evaluate("el => el.scrollWidth <= el.clientWidth", results.element_handle())  # no inner scroll
    for column in ("file_name", "channel", "tries", "error", "created"):
        assert page.locator(f"#result_list thead th.column-{column}").is_visible(), column
    texts = page.locator("#result_list tbody tr").first.inner_text()
    assert "just now" in texts or " ago" in texts  # times read as relative (absolute on hover)
    assert "quarterly-review-with-a-long-name.wav" in texts
    screenshot(page, "task-list-1280")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(live_server.url + "/console/")
    assert page.locator("nav.sluice-nav").is_visible()
    screenshot(page, "dashboard-390")
