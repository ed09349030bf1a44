"""The AWS Transcribe dialect end to end against a real S3 + Transcribe protocol server (moto's
server mode, started here), through Sluice's API and steps. The test plays the part AWS plays
beyond the API: when a job completes, it writes the transcript object to the output bucket.
Lost start answers are injected by the fake vendor in proxy mode between Sluice and the server."""

from __future__ import annotations

import json
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tasks.models import Task, VendorCall, VendorChannel, VendorJob
from tests.conftest import TEST_TIME_SCALE, run_until
from tests.support.flows import submit_file

pytestmark = pytest.mark.django_db(transaction=True)

REGION = "us-east-1"
MEDIA, OUTPUT = "sluice-media", "sluice-transcripts"
KEYS = dict(aws_access_key_id="testing", aws_secret_access_key="testing-secret")


class AWSPart:
    """What AWS does beyond answering calls: it writes each completed job's transcript object."""

    def __init__(self, url: str) -> None:
        import boto3

        self.transcribe = boto3.client("transcribe", endpoint_url=url, region_name=REGION, **KEYS)
        self.s3 = boto3.client("s3", endpoint_url=url, region_name=REGION, **KEYS)
        self.written: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def jobs(self) -> list[str]:
        return [j["TranscriptionJobName"] for j in self.transcribe.list_transcription_jobs()["TranscriptionJobSummaries"]]

    def _run(self) -> None:
        while not self._stop.is_set():
            for name in self.jobs():
                if name in self.written:
                    continue
                job = self.transcribe.get_transcription_job(TranscriptionJobName=name)["TranscriptionJob"]
                if job.get("TranscriptionJobStatus") != "COMPLETED":
                    continue
                text = f"transcript of {name}"
                uri = urlsplit(job["Transcript"]["TranscriptFileUri"]).path.lstrip("/")
                bucket, key = uri.split("/", 1)
                body = {"jobName": name, "status": "COMPLETED",
                        "results": {"transcripts": [{"transcript": text}], "items": []}}
                self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(body).encode())
                for sub in (job.get("Subtitles") or {}).get("SubtitleFileUris") or []:
                    sub_bucket, sub_key = urlsplit(sub).path.lstrip("/").split("/", 1)
                    self.s3.put_object(Bucket=sub_bucket, Key=sub_key,
                                       Body=f"WEBVTT\n\n00:00.000 --> 00:02.000\n{text}\n".encode())
                self.written[name] = text
            time.sleep(0.05)

    def __enter__(self) -> AWSPart:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def aws(moto_server, inline_queue):
    """moto reset, the buckets made, the primary channel speaking AWS Transcribe (alone)."""
    httpx.post(f"{moto_server}/moto-api/reset")
    part = AWSPart(moto_server)
    part.s3.create_bucket(Bucket=MEDIA)
    part.s3.create_bucket(Bucket=OUTPUT)
    VendorChannel.objects.filter(name="fallback").update(enabled=False)
    channel = VendorChannel.objects.get(name="primary")
    channel.dialect, channel.base_url, channel.kinds = "aws_transcribe", moto_server, ["transcription"]
    channel.api_key = f"{KEYS['aws_access_key_id']}:{KEYS['aws_secret_access_key']}"
    channel.dialect_settings = {"region": REGION, "media_bucket": MEDIA, "output_bucket": OUTPUT, "prefix": "t/",
                                "s3_endpoint_url": moto_server}
    channel.poll_initial_s = channel.poll_max_interval_s = 1
    channel.save()
    with part:
        yield part


@pytest.mark.parametrize("target", ["txt", "json", "vtt"])
def test_a_task_on_an_aws_transcribe_channel_succeeds_with_its_transcript(aws, api, target):
    task = run_until(submit_file(api, target=target), timeout=60)
    assert task.state == "SUCCEEDED", (task.error_code, task.error_message)
    job = VendorJob.objects.get(task=task)
    assert aws.jobs() == [job.vendor_job_id], "exactly one transcription job, named after the operation"
    record = aws.transcribe.get_transcription_job(TranscriptionJobName=job.vendor_job_id)["TranscriptionJob"]
    assert record["Media"]["MediaFileUri"].startswith(f"s3://{MEDIA}/t/media/")
    # The result is Sluice's now: the media and transcript objects are deleted, the job stays (its
    # name keeps refusing a late second start of the operation).
    assert aws.s3.list_objects_v2(Bucket=MEDIA).get("KeyCount") == 0
    assert aws.s3.list_objects_v2(Bucket=OUTPUT).get("KeyCount") == 0
    assert VendorCall.objects.filter(task=task, operation="release", outcome="ok").count() >= 3
    answer = api.get(f"/api/v1/tasks/{task.pk}/result")
    body = b"".join(answer.streaming_content) if answer.streaming else answer.content
    expected = aws.written[job.vendor_job_id]
    if target == "json":
        assert json.loads(body)["results"]["transcripts"][0]["transcript"] == expected
    else:
        assert expected in body.decode()
    assert set(VendorCall.objects.filter(task=task).values_list("operation", flat=True)) >= {
        "upload", "create_job", "get_job", "get_result"}


def test_lost_start_answers_end_with_exactly_one_job_per_task(aws, api, moto_server, tmp_path):
    from fakevendor.control import VendorControl
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "proxy")
    try:
        proxy = stack.start_vendor("proxy", time_scale=TEST_TIME_SCALE, extra_args=("--upstream", moto_server))
        control = VendorControl(proxy, "dev-admin-token")
        # Every start's answer is lost once the job was created: AWS holds the job, Sluice does not know.
        control.add_rule({"id": "lost-start", "endpoint": "POST /", "type": "response_lost", "params": {"mode": "reset"},
                          "match": {"header": {"X-Amz-Target": "Transcribe.StartTranscriptionJob"}}, "times": 3})
        VendorChannel.objects.filter(name="primary").update(base_url=proxy, upload_buffer_s=2, status_timeout_s=2)
        task_ids = [submit_file(api, key=f"lost-{n}") for n in range(3)]
        tasks = [run_until(task_id, timeout=90) for task_id in task_ids]
        assert [t.state for t in tasks] == ["SUCCEEDED"] * 3, [(t.error_code, t.error_message) for t in tasks]
        lost = control.journal(rule="lost-start")
        assert len(lost) == 3 and {e["outcome"] for e in lost} == {"response_lost:reset"}
        names = aws.jobs()
        assert len(names) == 3, f"one job per task, whatever was lost: {names}"
        assert sorted(VendorJob.objects.values_list("vendor_job_id", flat=True)) == sorted(names)
        assert all(job.adopted for job in VendorJob.objects.all()), "each job was found again by its name"
    finally:
        stack.stop_all()


def test_a_channel_with_incomplete_aws_settings_is_refused_by_the_console(admin_client):
    from django.urls import reverse

    channel = VendorChannel.objects.get(name="primary")
    url = reverse("admin:tasks_vendorchannel_change", args=[channel.pk])
    form = admin_client.get(url).context["adminform"].form
    data = {name: form.initial.get(name, field.initial) for name, field in form.fields.items()}
    data = {k: json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else v) for k, v in data.items()}
    data.update(dialect="aws_transcribe", kinds='["transcription"]', api_key="no-colon",
                dialect_settings='{"region": "us-east-1"}')
    answer = admin_client.post(url, data).content.decode()
    assert "media_bucket is required" in answer
    data.update(dialect_settings=json.dumps({"region": "us-east-1", "media_bucket": "b-ok"}))
    assert "ACCESS_KEY_ID:SECRET_ACCESS_KEY" in admin_client.post(url, data).content.decode()
    assert Task.objects.count() == 0
