"""A business user, in a real browser: log in, upload with the progress bar, follow the task until it
succeeds, download the result."""

from __future__ import annotations

import hashlib
import re

import pytest

from tasks.models import Task
from tasks.poc import files
from tasks.services.tenancy import tenant_user_ensure
from tests.e2e.conftest import screenshot, screenshots

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]


def test_a_business_user_uploads_follows_and_downloads(page, login, live_server, system, tenant, tmp_path):
    user, password = tenant_user_ensure(username="ann", tenant=tenant)
    login("ann", password, console=False)
    assert page.url.endswith("/tasks/")
    page.click("text=New task")
    recording = tmp_path / "board-meeting.wav"
    recording.write_bytes(files.wav(4))
    page.set_input_files("input[name=file]", str(recording))
    page.select_option("select[name=kind]", "transcription")
    page.select_option("select[name=target_format]", "srt")
    page.select_option("select[name=priority]", "interactive")
    page.click("button:has-text('Upload and submit')")
    page.wait_for_url(re.compile(r".*/tasks/[0-9a-f-]+/$"))
    task_id = page.url.rstrip("/").rsplit("/", 1)[1]
    screenshot(page, "portal-task-accepted")
    page.wait_for_function("() => document.querySelector('#task-state').innerText === 'SUCCEEDED'", timeout=60_000)
    assert page.locator("ol.timeline li").count() >= 4
    screenshot(page, "portal-task-succeeded")
    with page.expect_download() as download_info:
        page.click("a:has-text('Download')")
    assert download_info.value.suggested_filename == "board-meeting.srt"
    path = download_info.value.path()
    body = open(path, "rb").read()
    assert hashlib.sha256(body).hexdigest() == Task.objects.get(pk=task_id).result_sha256 and b"-->" in body
    page.click("nav >> text=Tasks")
    assert page.locator(f"tr[data-task='{task_id}'] [data-field=state]").inner_text() == "SUCCEEDED"
    assert page.locator(f"tr[data-task='{task_id}'] [data-field=name]").inner_text() == "board-meeting.wav"
    screenshots(page, "portal-task-list")


def test_form_errors_show_next_to_the_field_without_losing_anything(page, login, live_server, tenant, tmp_path):
    user, password = tenant_user_ensure(username="bob", tenant=tenant)
    login("bob", password, console=False)
    page.goto(f"{live_server.url}/tasks/new/")
    document = tmp_path / "report.pdf"
    document.write_bytes(files.pdf(2))
    page.set_input_files("input[name=file]", str(document))
    page.select_option("select[name=kind]", "transcription")
    page.select_option("select[name=target_format]", "txt")
    page.click("button:has-text('Upload and submit')")
    page.wait_for_selector(".error[data-error-for]")
    assert "needs audio" in page.locator(".error[data-error-for]").first.inner_text()
    assert Task.objects.count() == 0
    assert page.locator("form progress").is_hidden()  # the bar does not stay full after a refusal
    screenshot(page, "portal-form-error")


def options(page, name: str) -> list[str]:
    return page.eval_on_selector_all(f"select[name={name}] option", "els => els.map(e => e.value)")


def test_the_form_offers_only_the_formats_of_the_kind_chosen(page, login, live_server, tenant):
    user, password = tenant_user_ensure(username="cy", tenant=tenant)
    login("cy", password, console=False)
    page.goto(f"{live_server.url}/tasks/new/")
    assert page.input_value("select[name=kind]") == "transcription"
    assert sorted(options(page, "target_format")) == ["json", "srt", "txt", "vtt"]
    assert page.input_value("select[name=target_format]") == "txt"  # a valid default
    page.select_option("select[name=kind]", "conversion")
    assert sorted(options(page, "target_format")) == ["html", "md", "pdf", "txt"]
    screenshots(page, "portal-upload-form")


def test_new_tasks_appear_live_and_cancel_asks_first_then_says_who_cancelled(page, login, live_server, tenant, api):
    from tests.support.flows import submit_file

    user, password = tenant_user_ensure(username="dee", tenant=tenant)
    login("dee", password, console=False)
    assert page.locator("tr[data-task]").count() == 0
    task_id = submit_file(api, name="weekly-sync.wav")  # another client of the same organisation
    page.wait_for_selector(f"tr[data-task='{task_id}']", timeout=15_000)
    assert page.locator(f"tr[data-task='{task_id}'] [data-field=name]").inner_text() == "weekly-sync.wav"
    # At a phone's width the task link and Log out stay on screen.
    page.set_viewport_size({"width": 390, "height": 844})
    for locator in (page.locator(f"tr[data-task='{task_id}'] a"), page.locator("button:has-text('Log out')")):
        box = locator.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, box
    screenshot(page, "portal-task-list-390")
    page.set_viewport_size({"width": 1280, "height": 900})
    page.click(f"tr[data-task='{task_id}'] a")
    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("button:has-text('Cancel task')")
    assert asked and "cannot be undone" in asked[0]
    assert Task.objects.get(pk=task_id).state == "ACCEPTED"
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Cancel task')")
    page.wait_for_selector("[data-field=outcome]")
    assert page.locator("[data-field=outcome]").inner_text() == "Cancelled by you."
    assert Task.objects.get(pk=task_id).state == "CANCELLED"
    screenshots(page, "portal-cancelled-by-you")
