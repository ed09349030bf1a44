"""A business user, in a real browser: log in, upload with the progress bar, follow the task until it
succeeds, download the result."""

from __future__ import annotations

import hashlib
import re

import pytest

from tasks.models import Task
from tasks.poc import files
from tasks.services.tenancy import tenant_user_ensure
from tests.e2e.conftest import screenshot

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
    path = download_info.value.path()
    body = open(path, "rb").read()
    assert hashlib.sha256(body).hexdigest() == Task.objects.get(pk=task_id).result_sha256 and b"-->" in body
    page.click("nav >> text=Tasks")
    assert page.locator(f"tr[data-task='{task_id}'] [data-field=state]").inner_text() == "SUCCEEDED"
    screenshot(page, "portal-task-list")


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
    screenshot(page, "portal-form-error")
