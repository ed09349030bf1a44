"""The AssemblyAI dialect end to end: the vendor's own SDK against the fake vendor's emulation, and
Sluice's adapter through the API, with the guarantees its capabilities allow."""

from __future__ import annotations

import hashlib

import pytest

from tasks.models import Task, VendorChannel, VendorJob
from tasks.poc import files
from tests.conftest import run_until
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def assemblyai_only(vendor, **values):
    """The primary channel speaks AssemblyAI (the fake vendor's /assemblyai prefix), alone."""
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    VendorChannel.objects.filter(name="primary").update(
        dialect="assemblyai", base_url=f"{vendor.url}/assemblyai", kinds=["transcription"], **values)
    vendor.control.channel("assemblyai", processing_ms=400, queue_ms=50)


def journal(vendor, endpoint: str) -> list[dict]:
    return [e for e in vendor.control.journal() if e["endpoint"] == endpoint]


def test_the_official_sdk_transcribes_a_file_against_the_fake_vendor(vendor, tmp_path):
    import assemblyai as aai

    vendor.control.channel("assemblyai", processing_ms=300, queue_ms=20)
    audio = tmp_path / "meeting.wav"
    audio.write_bytes(files.wav(3))
    aai.settings.base_url = f"{vendor.url}/assemblyai"
    aai.settings.api_key = "dev-vendor-key"
    aai.settings.polling_interval = 0.05
    transcript = aai.Transcriber().transcribe(str(audio))
    assert transcript.status == aai.TranscriptStatus.completed, transcript.error
    assert transcript.text and len(transcript.text.split()) > 20
    assert transcript.id and transcript.audio_url.startswith(f"{vendor.url}/assemblyai/v2/upload/")
    # Its subtitles, its place in the list, and its deletion, as the SDK sees them.
    assert transcript.export_subtitles_srt().startswith("1\n00:00:00,000 --> ")
    assert transcript.export_subtitles_vtt().startswith("WEBVTT")
    listed = aai.Transcriber().list_transcripts()
    assert listed.transcripts[0].id == transcript.id and listed.page_details.result_count == 1
    deleted = aai.Transcript.delete_by_id(transcript.id)
    assert deleted.audio_url == "http://deleted_by_user"
    assert [e["endpoint"] for e in vendor.control.journal()][:2] == ["POST /v2/upload", "POST /v2/transcript"]
    assert vendor.control.invariants()["billed_jobs"] == 1


def test_the_sdk_sees_the_vendors_errors_as_the_vendor_answers_them(vendor, tmp_path):
    import assemblyai as aai

    aai.settings.base_url = f"{vendor.url}/assemblyai"
    aai.settings.api_key = "wrong-key"
    with pytest.raises(aai.types.TranscriptError) as refused:
        aai.Transcriber().submit("http://127.0.0.1:1/nowhere.wav")
    assert refused.value.status_code == 401
    aai.settings.api_key = "dev-vendor-key"
    vendor.control.add_rule({"endpoint": "POST /v2/upload", "type": "rate_limit", "params": {"retry_after_s": 3}, "times": 1})
    with pytest.raises(aai.types.TranscriptError) as limited:
        aai.Transcriber().transcribe(files.wav(1))
    assert limited.value.status_code == 429


@pytest.mark.parametrize("target", ["txt", "srt", "vtt", "json"])
def test_a_task_on_an_assemblyai_channel_succeeds_with_a_digest_matching_result(inline_queue, api, target):
    assemblyai_only(inline_queue)
    task = run_until(submit_file(api, target=target))
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    answer = api.get(f"/api/v1/tasks/{task.pk}/result")
    body = b"".join(answer.streaming_content) if answer.streaming else answer.content
    assert answer.status_code == 200 and hashlib.sha256(body).hexdigest() == answer["X-Content-SHA256"] == task.result_sha256
    if target == "srt":
        assert body.startswith(b"1\n")
    creates = journal(inline_queue, "POST /v2/transcript")
    assert len(creates) == 1 and inline_queue.control.invariants()["billed_jobs"] == 1


def test_a_lost_create_answer_is_reconciled_by_the_upload_url_and_the_transcript_adopted(inline_queue, api):
    assemblyai_only(inline_queue, upload_buffer_s=2, status_timeout_s=2)
    inline_queue.control.add_rule({"endpoint": "POST /v2/transcript", "type": "response_lost", "params": {"mode": "reset"},
                                   "times": 1})
    task = run_until(submit_file(api))
    assert task.state == "SUCCEEDED"
    assert len(journal(inline_queue, "POST /v2/transcript")) == 1, "nothing was resent after the lost answer"
    assert journal(inline_queue, "GET /v2/transcript"), "reconciliation listed the transcripts"
    assert VendorJob.objects.get(task=task).adopted
    assert inline_queue.control.invariants()["billed_jobs"] == 1


def test_a_vendor_declared_unsearchable_holds_an_ambiguous_create_for_an_operator(inline_queue, api, admin_client):
    """reconcile_by none: nothing is resent blindly; the operator's decision (here: resend, accepting
    that the lost create may have been billed) is confirmed, audited and in the task's history."""
    from tasks.models import AuditEntry
    from tasks.services.dispatch import tick

    assemblyai_only(inline_queue, capability_overrides={"reconcile_by": "none"}, upload_buffer_s=2, status_timeout_s=2)
    inline_queue.control.add_rule({"endpoint": "POST /v2/transcript", "type": "response_lost", "params": {"mode": "reset"},
                                   "times": 1})
    task = run_until(submit_file(api), states=("RECONCILING",))
    for _ in range(20):
        tick()
    task = Task.objects.get(pk=task.pk)
    assert task.state == "RECONCILING" and task.waiting_reason == "needs_operator"
    assert len(journal(inline_queue, "POST /v2/transcript")) == 1 and not journal(inline_queue, "GET /v2/transcript")
    page = admin_client.get(f"/console/tasks/task/{task.pk}/change/")
    assert b"Resend (I accept a possible duplicate)" in page.content and b"needs_operator" in page.content
    unconfirmed = admin_client.post(f"/console/task/{task.pk}/resend_accept_duplicate/")
    assert unconfirmed.status_code == 302 and Task.objects.get(pk=task.pk).state == "RECONCILING"
    admin_client.post(f"/console/task/{task.pk}/resend_accept_duplicate/", {"confirm": "yes"})
    assert AuditEntry.objects.filter(action="task_resend_accept_duplicate", target_id=str(task.pk), done=1).exists()
    task = run_until(task.pk)
    assert task.state == "SUCCEEDED"
    assert inline_queue.control.invariants()["billed_jobs"] == 2
    assert any(e.data.get("operator_decision") == "resend" for e in task.events.all())
