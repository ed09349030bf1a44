"""Operators' recovery stories in a real browser, each from the page a person starts on to the
audited outcome: release and replay from quarantine, an outage (banner → waiting tasks → retry),
replaying a triage group, a quota override with a bad range, billing's drill-down."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console.staff import staff_ensure
from tasks.lifecycle import transition
from tasks.models import AuditEntry, ChannelHealth, Quarantine, QuotaOverride, Task
from tasks.poc import files
from tests.e2e.conftest import screenshots
from tests.support.flows import route, submit_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]


def staff(role: str) -> tuple[str, str]:
    user, password = staff_ensure(username=f"{role}-story", role=role, actor="test")
    return user.username, password


def accept_confirmations(page) -> list[str]:
    """Irreversible actions ask first: the story says yes, and keeps what it was asked."""
    asked: list[str] = []

    def on_dialog(dialog):
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", on_dialog)
    return asked


@pytest.fixture
def control_cluster(tmp_path, transactional_db):
    from tasks.system import Stack
    from tests.conftest import TEST_TIME_SCALE

    stack = Stack(log_dir=tmp_path / "cluster", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE)})
    stack.start_cluster(None, workers=1)
    yield stack
    stack.stop_all()


def test_release_and_replay_from_quarantine_with_overrides(page, login, live_server, api, vendor):
    task_id = submit_file(api, files.truncated_pdf(), name="contract.pdf", kind="conversion", target="txt")
    assert route(task_id).state == "FAILED"
    entry = Quarantine.objects.get()
    asked = accept_confirmations(page)
    login(*staff("operator"))
    page.click("nav.sluice-nav >> text=Quarantine")
    page.click(f"#result_list a[href*='/quarantine/{entry.pk}/']")
    assert "damaged or incomplete" in page.locator("#quarantine-summary").inner_text()
    assert task_id[:8] in page.locator("#quarantine-summary").inner_text()
    # A typo in the overrides is refused with a message, and what was typed is still there.
    page.fill("#quarantine-actions input[name=params]", '{"language": "de"')
    page.click("[data-action=release]")
    page.wait_for_selector(".messagelist .error")
    assert page.locator("#quarantine-actions input[name=params]").input_value() == '{"language": "de"'
    assert Quarantine.objects.get().released_at is None
    page.fill("#quarantine-actions input[name=params]", '{"language": "de"}')
    page.click("[data-action=release]")
    page.wait_for_selector(".messagelist .success")
    assert "1 task(s) replayed" in page.locator(".messagelist").inner_text()
    assert any("replay its 1 task" in message for message in asked)
    screenshots(page, "story-quarantine-released")
    task = Task.objects.get(pk=task_id)
    assert task.state == "QUEUED" and task.lane_id == "unknown-risk" and task.params.get("language") == "de"
    assert AuditEntry.objects.filter(action="quarantine_release", actor="operator-story", done=1).exists()


def test_the_outage_story_from_the_dashboard_banner_to_retried_work_in_four_clicks(page, login, live_server, api,
                                                                                  control_cluster):
    ids = []
    for _ in range(4):
        task = Task.objects.get(pk=submit_file(api))
        moved = transition(task.pk, source="ACCEPTED", target="QUEUED", generation=0, actor="test", reason="routed",
                           fields={"channel_id": "primary", "lane_id": "interactive"})
        transition(task.pk, source="QUEUED", target="RETRY_WAIT", generation=moved.generation, actor="test",
                   reason="vendor unavailable", fields={"waiting_reason": "breaker_open",
                                                        "due_at": timezone.now() + timedelta(hours=1)})
        ids.append(str(task.pk))
    ChannelHealth.objects.update_or_create(channel_id="primary", defaults={"breaker_state": "OPEN", "opened_at": timezone.now()})
    login(*staff("operator"))
    banner = page.locator("[data-outage=primary]")
    assert "4 task(s) wait on it" in banner.inner_text()
    screenshots(page, "story-outage-dashboard")
    page.click("[data-outage=primary] [data-action=outage-tasks]")  # 1
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 4
    assert page.locator("#result_list .sluice-waiting-code").first.inner_text() == "breaker_open"
    screenshots(page, "story-outage-tasks")
    page.click("a.sluice-bulk:has-text('Retry now all 4 matching')")  # 2
    assert page.locator("[data-field=count]").inner_text() == "4"
    assert "tasks held by channel primary" in page.locator("[data-field=selection]").inner_text()
    page.click("button:has-text('Run in the background')")  # 3
    page.wait_for_function("() => document.querySelector('[data-field=status]').innerText === 'done'", timeout=60_000)
    assert page.locator("[data-field=done]").inner_text() == "4"
    assert all(t.due_at <= timezone.now() for t in Task.objects.filter(pk__in=ids))
    page.click("text=audit log")  # 4
    assert page.locator("text=bulk_retry_now").count() >= 1
    assert AuditEntry.objects.get(action="bulk_retry_now").done == 4


def test_a_triage_group_is_replayed_from_the_triage_page(page, login, live_server, api, control_cluster):
    group = []
    for n in range(3):
        task = Task.objects.get(pk=submit_file(api))
        transition(task.pk, source="ACCEPTED", target="FAILED", generation=0, actor="test", reason="engine",
                   fields={"error_code": "engine_error" if n < 2 else "retries_exhausted", "channel_id": "primary"})
        group.append(str(task.pk))
    login(*staff("operator"))
    page.click("nav.sluice-nav >> text=Triage")
    row = page.locator("#triage tr", has_text="engine_error")
    row.locator("text=replay group…").click()
    assert page.locator("[data-field=count]").inner_text() == "2"
    assert "failed with engine_error" in page.locator("[data-field=selection]").inner_text()
    page.click("button:has-text('Run in the background')")
    page.wait_for_function("() => document.querySelector('[data-field=status]').innerText === 'done'", timeout=60_000)
    states = dict(Task.objects.filter(pk__in=group).values_list("pk", "state"))
    assert sorted(states.values()) == ["FAILED", "QUEUED", "QUEUED"]
    assert AuditEntry.objects.get(action="bulk_replay").done == 2
    screenshots(page, "story-triage-replayed")


def test_a_quota_override_with_its_end_before_its_start_is_refused_with_a_message(page, login, live_server, tenant):
    login(*staff("admin"))
    page.goto(f"{live_server.url}/console/tasks/tenant/{tenant.pk}/change/")
    page.click("#quota_overrides-group .add-row a")
    page.fill("input[name='quota_overrides-0-value']", "50")
    page.select_option("select[name='quota_overrides-0-field']", index=1)
    page.fill("input[name='quota_overrides-0-starts_at_0']", "2026-12-02")
    page.fill("input[name='quota_overrides-0-starts_at_1']", "10:00:00")
    page.fill("input[name='quota_overrides-0-ends_at_0']", "2026-12-01")
    page.fill("input[name='quota_overrides-0-ends_at_1']", "10:00:00")
    page.click("input[name=_save]")
    page.wait_for_load_state()
    assert "must end after it starts" in page.locator("#content").inner_text()
    assert QuotaOverride.objects.count() == 0
    screenshots(page, "story-quota-override-refused")


def test_billing_drill_down_links_open_the_tasks_they_count(page, login, live_server, api):
    from tasks.models import LedgerEntry, VendorJob

    task = Task.objects.get(pk=submit_file(api))
    transition(task.pk, source="ACCEPTED", target="FAILED", generation=0, actor="test", reason="vendor failed",
               fields={"error_code": "transcription_error", "channel_id": "primary"})
    job = VendorJob.objects.create(task=task, channel_id="primary", vendor_job_id="job-1", client_ref="ref-1",
                                   status="failed")
    LedgerEntry.objects.create(channel_id="primary", entry_id="entry-1", job_id=job.vendor_job_id, client_ref="ref-1", units=1,
                               amount_cents=7, billed_at=timezone.now())
    login(*staff("viewer"))
    page.click("nav.sluice-nav >> text=Billing")
    page.click("#billing [data-link=billed-failed]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 1
    assert str(task.pk)[:8] in page.locator("#result_list").inner_text()
    screenshots(page, "story-billing-drill-down")
    for link in page.locator("#content a[href]").all()[:40]:
        href = link.get_attribute("href")
        if href and href.startswith("/console/") and "logout" not in href:
            assert page.request.get(live_server.url + href).status < 500, href
