"""The AWS Transcribe dialect's pure decisions: job names, settings, status and error mapping."""

from __future__ import annotations

import json

import pytest

from tasks.vendors.aws_transcribe import (
    NOT_FOUND,
    SettingsError,
    _client_error_row,
    _export,
    _job_view,
    job_name,
    validate_settings,
)
from tasks.vendors.classification import Outcome
from tasks.vendors.errors import MalformedResponse
from tasks.vendors.protocol import Operation


def test_the_job_name_is_the_operations_key_in_the_characters_aws_allows():
    assert job_name(Operation(client_ref="c", idempotency_key="sluice-ab12")) == "sluice-ab12"
    assert job_name(Operation(client_ref="c", idempotency_key="a b/c:d")) == "a-b-c-d"
    assert len(job_name(Operation(client_ref="c", idempotency_key="k" * 300))) == 200


@pytest.mark.parametrize("values,key,message", [
    ({"region": "eu-west-1"}, "a:b", "media_bucket is required"),
    ({"media_bucket": "b-1"}, "a:b", "region is required"),
    ({"region": "eu-west-1", "media_bucket": "Bad_Bucket"}, "a:b", "not an S3 bucket name"),
    ({"region": "eu-west-1", "media_bucket": "b-1", "colour": "red"}, "a:b", "colour not known"),
    ({"region": "eu-west-1", "media_bucket": "b-1"}, "no-colon", "ACCESS_KEY_ID:SECRET_ACCESS_KEY"),
    ("not an object", "a:b", "JSON object"),
])
def test_settings_are_refused_with_what_is_wrong(values, key, message):
    with pytest.raises(SettingsError) as refused:
        validate_settings(values, key)
    assert message in str(refused.value)


def test_statuses_map_and_a_start_answer_without_one_is_queued():
    assert _job_view({"TranscriptionJobName": "n", "TranscriptionJobStatus": "IN_PROGRESS"}, "n").status == "processing"
    assert _job_view({}, "n").status == "queued" and _job_view({}, "n").id == "n"
    failed = _job_view({"TranscriptionJobStatus": "FAILED", "FailureReason": "bad media"}, "n")
    assert failed.status == "failed" and failed.error_message == "bad media"
    with pytest.raises(MalformedResponse):
        _job_view({"TranscriptionJobStatus": "EXPLODED"}, "n")


def test_aws_errors_are_classified_like_any_vendor_answer():
    assert _client_error_row(400, "ThrottlingException").outcome == Outcome.NOT_PROCESSED
    assert _client_error_row(400, "LimitExceededException").flow_control
    assert _client_error_row(500, "InternalFailureException").outcome == Outcome.AMBIGUOUS
    assert _client_error_row(403, "UnrecognizedClientException").outcome == Outcome.REFUSED
    assert _client_error_row(400, "BadRequestException").outcome == Outcome.REFUSED
    assert NOT_FOUND.outcome == Outcome.REFUSED


def test_the_transcript_object_becomes_text_or_json():
    raw = json.dumps({"results": {"transcripts": [{"transcript": "hello there"}]}}).encode()
    assert _export(raw, "txt") == (b"hello there\n", "text/plain; charset=utf-8")
    assert json.loads(_export(raw, "json")[0])["results"]["transcripts"][0]["transcript"] == "hello there"
    with pytest.raises(MalformedResponse):
        _export(b'{"results": {}}', "txt")
