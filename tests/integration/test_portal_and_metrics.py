"""Forms for business users (same services as the API), and Prometheus metrics."""

import io

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from tasks.models import Task
from tasks.poc import files
from tasks.services.tenancy import tenant_user_ensure

pytestmark = pytest.mark.django_db


@pytest.fixture
def portal(client, tenant):
    user, password = tenant_user_ensure(username="ann", tenant=tenant)
    assert client.login(username="ann", password=password)
    return client


def test_login_page_renders_and_protects_the_task_list(client):
    assert client.get("/login/").status_code == 200
    answer = client.get("/tasks/")
    assert answer.status_code == 302 and answer["Location"].startswith("/login/")


def test_upload_form_accepts_a_task_and_shows_its_timeline(portal):
    answer = portal.post("/tasks/new/", {
        "file": SimpleUploadedFile("talk.wav", files.wav(), "audio/wav"), "kind": "transcription",
        "target_format": "srt", "priority": "interactive",
    })
    task = Task.objects.get()
    assert answer.status_code == 302 and answer["Location"] == f"/tasks/{task.pk}/"
    page = portal.get(answer["Location"]).content.decode()
    assert "ACCEPTED" in page and "Timeline" in page and "Cancel task" in page
    listing = portal.get("/tasks/").content.decode()
    assert str(task.pk) in listing


def test_form_errors_appear_next_to_the_field_and_nothing_is_stored(portal):
    answer = portal.post("/tasks/new/", {
        "file": SimpleUploadedFile("talk.wav", files.wav(), "audio/wav"), "kind": "transcription",
        "target_format": "pdf", "priority": "batch",
    })
    assert answer.status_code == 400
    assert 'data-error-for="target_format"' in answer.content.decode()
    assert Task.objects.count() == 0


def test_the_senders_file_name_is_only_a_label_and_a_too_long_one_is_refused_on_the_form(portal):
    odd = "../../" + "é" * 100 + ".wav"
    answer = portal.post("/tasks/new/", {
        "file": SimpleUploadedFile(odd, files.wav(), "audio/wav"), "kind": "transcription",
        "target_format": "srt", "priority": "batch",
    })
    assert answer.status_code == 302
    assert Task.objects.get().file.label == odd.split("/")[-1]

    too_long = io.BytesIO(files.wav())
    too_long.name = "n" * 300 + ".wav"  # as a browser sends it (an UploadedFile would shorten it here)
    answer = portal.post("/tasks/new/", {
        "file": too_long, "kind": "transcription",
        "target_format": "srt", "priority": "batch",
    })
    assert answer.status_code == 400 and "longer than 255 characters" in answer.content.decode()
    assert Task.objects.count() == 1


def test_the_same_refusal_as_the_api_is_shown_on_the_form(portal):
    answer = portal.post("/tasks/new/", {
        "file": SimpleUploadedFile("report.pdf", files.pdf(), "application/pdf"), "kind": "transcription",
        "target_format": "txt", "priority": "batch",
    })
    assert answer.status_code == 400 and "needs audio" in answer.content.decode()


def test_cancel_from_the_task_page(portal):
    portal.post("/tasks/new/", {"file": SimpleUploadedFile("t.wav", files.wav(), "audio/wav"), "kind": "transcription",
                                "target_format": "txt", "priority": "batch"})
    task = Task.objects.get()
    answer = portal.post(f"/tasks/{task.pk}/cancel/", follow=True)
    assert "CANCELLED" in answer.content.decode()
    assert Task.objects.get().state == "CANCELLED"


def test_another_tenants_task_is_not_found_on_the_forms(portal, db):
    from tasks.services.tenancy import tenant_ensure

    other = tenant_ensure(name="other")
    from django.test import Client

    from tasks.services.tenancy import token_issue
    from tests.support.flows import submit_file

    api = Client(HTTP_AUTHORIZATION=f"Bearer {token_issue(tenant=other).token}")
    task_id = submit_file(api)
    assert portal.get(f"/tasks/{task_id}/").status_code == 404
    portal.post(f"/tasks/{task_id}/cancel/")
    assert Task.objects.get(pk=task_id).state == "ACCEPTED"


def test_metrics_expose_vendor_and_task_series(client, api):
    from tests.support.flows import submit_file

    submit_file(api)
    body = client.get("/metrics").content.decode()
    for name in ("sluice_vendor_calls_total", "sluice_retries_total", "sluice_reconciliations_total",
                 "sluice_duplicate_incidents_total", "sluice_breaker_state", "sluice_tasks"):
        assert name in body
    assert 'sluice_tasks{state="ACCEPTED"} 1.0' in body
