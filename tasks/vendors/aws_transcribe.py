"""The `aws_transcribe` dialect: AWS Transcribe through boto3, its media and transcripts in S3.

The file goes to the channel's media bucket (S3 multipart for large files, streamed from disk);
`StartTranscriptionJob` is called with a job name derived from the operation's idempotency key,
so a second start of the same operation is refused by AWS with a ConflictException and the job
is then found by name (`GetTranscriptionJob`): the `unique_name` capability. A start whose answer
is lost is reconciled the same way, so a task never holds two jobs. Polling is
`GetTranscriptionJob`; the result is the transcript object AWS writes to the output bucket (txt:
its text, json: the object; srt/vtt: the subtitle files requested at the start); clean-up is
`DeleteTranscriptionJob` (AWS cannot stop a running job).

Channel: `base_url` is the Transcribe endpoint (https://transcribe.<region>.amazonaws.com, or an
S3/Transcribe-compatible server), `api_key` is `ACCESS_KEY_ID:SECRET_ACCESS_KEY`, and
`dialect_settings` holds `region`, `media_bucket`, `output_bucket` (default: the media bucket),
`prefix`, `s3_endpoint_url` (default: AWS's, or base_url when that is not an amazonaws.com host)
and `language_code` (default en-US).

Every call goes through the channel's breaker, is classified with the one table and recorded as
a VendorCall, like the HTTP dialects (tasks/vendors/http.py); botocore's own retries are off:
retrying is the steps' decision.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.db import connection

from tasks import timescale
from tasks.models import VendorChannel
from tasks.vendors import breaker
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.classification import Outcome, Row, classify_exception, classify_status
from tasks.vendors.errors import (
    BreakerOpen,
    DownloadDeadlineExceeded,
    MalformedResponse,
    UploadDeadlineExceeded,
    VendorError,
)
from tasks.vendors.http import VendorHttp
from tasks.vendors.protocol import (
    BillingPage,
    CallbackEvent,
    CallbackRejected,
    Created,
    FetchedResult,
    JobRequest,
    JobView,
    Operation,
    UploadReceipt,
)

CAPABILITIES = Capabilities(
    idempotency_key=False, reconcile_by="unique_name", cancel=False, callbacks=False, reports_input_digest=False,
    result="export", billing_ledger=False, kinds=frozenset({"transcription"}), upload_modes=frozenset({"two_step"}),
)
STATUSES = {"QUEUED": "queued", "IN_PROGRESS": "processing", "COMPLETED": "completed", "FAILED": "failed"}
SUBTITLES = ("srt", "vtt")
SETTINGS = ("region", "media_bucket", "output_bucket", "prefix", "s3_endpoint_url", "language_code")
PART_BYTES = 8 * 1024 * 1024
# The transcript object is written by AWS as the job completes; until it is there, a fetch is
# simply early (not a refusal).
NOT_YET = Row(Outcome.NOT_PROCESSED, True, "the transcript is not in the output bucket yet")
NOT_FOUND = Row(Outcome.REFUSED, False, "AWS Transcribe does not know this job")
THROTTLED = classify_status(429)
# botocore's transport failures, as the classification table names them.
BOTOCORE_EXCEPTIONS = {
    "EndpointConnectionError": "ConnectError", "ConnectTimeoutError": "ConnectTimeout",
    "ProxyConnectionError": "ConnectError", "ReadTimeoutError": "ReadTimeout",
    "ConnectionClosedError": "RemoteProtocolError", "ResponseParserError": "MalformedResponse",
    "S3UploadFailedError": "WriteError",
}
# Failures of ours before anything was sent: refused, and never held against the vendor's breaker.
REFUSED_LOCALLY = {
    "ParamValidationError": Row(Outcome.REFUSED, False, "the request is not valid for AWS (check the task's options)"),
    "NoCredentialsError": Row(Outcome.REFUSED, False, "no AWS credentials: set the channel's api_key"),
    "PartialCredentialsError": Row(Outcome.REFUSED, False, "incomplete AWS credentials in the channel's api_key"),
}
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


class SettingsError(ValueError):
    """The channel's dialect_settings or API key are not what this dialect needs."""


def validate_settings(values: Any, api_key: str) -> dict[str, str]:
    """The channel's settings for this dialect, checked (SettingsError says what is wrong)."""
    if not isinstance(values, dict):
        raise SettingsError('dialect_settings: give a JSON object, e.g. {"region": "eu-west-1", "media_bucket": "b"}')
    unknown = sorted(set(values) - set(SETTINGS))
    if unknown:
        raise SettingsError(f"dialect_settings: {', '.join(unknown)} not known (known: {', '.join(SETTINGS)})")
    for name in ("region", "media_bucket"):
        if not isinstance(values.get(name), str) or not values[name]:
            raise SettingsError(f"dialect_settings: {name} is required")
    for name, value in values.items():
        if not isinstance(value, str):
            raise SettingsError(f"dialect_settings: {name} must be a string")
    for name in ("media_bucket", "output_bucket"):
        if values.get(name) and not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", values[name]):
            raise SettingsError(f"dialect_settings: {name} is not an S3 bucket name")
    if ":" not in (api_key or ""):
        raise SettingsError("api_key: give ACCESS_KEY_ID:SECRET_ACCESS_KEY")
    return values


def job_name(operation: Operation) -> str:
    """The operation's job name: AWS refuses a second job of the same name (`unique_name`)."""
    return re.sub(r"[^0-9A-Za-z._-]", "-", operation.idempotency_key)[:200]


class AWSTranscribeAdapter:
    capabilities = CAPABILITIES

    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                 deadline: datetime | None = None) -> None:
        self.channel = channel
        self.capabilities = CAPABILITIES.narrowed(channel.capability_overrides)
        # The HTTP dialects' bookkeeping (time layers, call records, breaker feeding), reused.
        self.calls = VendorHttp(channel, task_id=task_id, generation=generation, deadline=deadline, auth_headers={},
                                error_details=lambda response: (None, ""))
        self.settings = dict(channel.dialect_settings or {})
        self.prefix = self.settings.get("prefix", "")
        self.media_bucket = self.settings.get("media_bucket", "")
        self.output_bucket = self.settings.get("output_bucket") or self.media_bucket

    # --- clients --------------------------------------------------------------------------------
    def _client(self, service: str, *, read_s: float | None = None) -> Any:
        import boto3
        from botocore.config import Config

        access_key, _, secret_key = (self.channel.api_key or ":").partition(":")
        endpoint = self.channel.base_url.rstrip("/") if service == "transcribe" else self._s3_endpoint()
        # The channel's timeouts (not cut to what is left of the attempt: one client per setting,
        # and the steps' deadlines still bound how long an attempt waits).
        connect = round(timescale.seconds(self.calls.timeouts.connect_s), 1)
        read = round(timescale.seconds(read_s or self.calls.timeouts.status_s), 1)
        key = (os.getpid(), service, endpoint, self.settings.get("region"), access_key,
               hashlib.sha256(secret_key.encode()).hexdigest(), connect, read)
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                config = Config(connect_timeout=max(connect, 0.5), read_timeout=max(read, 0.5),
                                retries={"total_max_attempts": 1}, s3={"addressing_style": "path"},
                                max_pool_connections=16)
                client = boto3.session.Session().client(
                    service, endpoint_url=endpoint or None, region_name=self.settings.get("region"),
                    aws_access_key_id=access_key, aws_secret_access_key=secret_key, config=config)
                _clients[key] = client
        return client

    def _s3_endpoint(self) -> str:
        if self.settings.get("s3_endpoint_url"):
            return self.settings["s3_endpoint_url"].rstrip("/")
        host = urlsplit(self.channel.base_url).hostname or ""
        return "" if host.endswith(".amazonaws.com") else self.channel.base_url.rstrip("/")

    def _call(self, operation: str, fn: Callable[[], Any], *, errors: Mapping[str, Row] | None = None) -> Any:
        """One AWS call: breaker permit, classification of any failure, a VendorCall row."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        if connection.in_atomic_block:
            raise RuntimeError("no vendor call may be made inside a database transaction")
        try:
            permit = breaker.acquire(self.channel)
        except BreakerOpen as exc:
            row = classify_exception("BreakerOpen")
            self.calls.record(operation, row, error_class="BreakerOpen", duration=0.0, counted=False)
            raise VendorError(row, operation=operation, error_class="BreakerOpen") from exc
        started = time.monotonic()
        try:
            result = fn()
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code") or ""
            message = str(exc.response.get("Error", {}).get("Message") or "")[:200]
            row = (errors or {}).get(code) or _client_error_row(status, code)
            self.calls.record(operation, row, status=status, duration=time.monotonic() - started, permit=permit,
                              code=code[:64])
            raise VendorError(row, operation=operation, status=status, code=code[:64] or None, detail=message) from None
        except (BotoCoreError, Boto3Error, UploadDeadlineExceeded, DownloadDeadlineExceeded, MalformedResponse,
                OSError) as exc:
            name = BOTOCORE_EXCEPTIONS.get(type(exc).__name__, type(exc).__name__)
            cause = exc.__context__ if isinstance(exc.__context__, ClientError) else None
            if cause is not None:  # an S3 transfer that failed on an AWS answer: that answer decides
                code = cause.response.get("Error", {}).get("Code") or ""
                row = _client_error_row(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode"), code)
            elif name in REFUSED_LOCALLY:
                row = REFUSED_LOCALLY[name]
            else:
                row = classify_exception(name)
            self.calls.record(operation, row, error_class=name, duration=time.monotonic() - started, permit=permit,
                              counted=row.outcome != Outcome.REFUSED)
            raise VendorError(row, operation=operation, error_class=name, detail=str(exc)[:200]) from None
        self.calls.record(operation, Row(Outcome.OK, False, "ok"), status=200, duration=time.monotonic() - started,
                          permit=permit)
        return result

    # --- the seam ---------------------------------------------------------------------------------
    def upload(self, path: Path, *, size: int, sha256: str, operation: Operation,
               on_chunk: Callable[[int], None] | None = None) -> UploadReceipt:
        from boto3.s3.transfer import TransferConfig

        key = f"{self.prefix}media/{re.sub(r'[^0-9A-Za-z._-]', '-', operation.client_ref)}/{sha256[:32]}"
        deadline = self.calls.wall_clock(timescale.seconds(self.calls.timeouts.upload_budget_s(size)))

        def progress(sent: int) -> None:
            if time.monotonic() > deadline:
                raise UploadDeadlineExceeded()
            if on_chunk is not None:
                on_chunk(sent)

        # In this thread: the progress callback renews the step's lease in the database.
        transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, use_threads=False)
        s3 = self._client("s3", read_s=self.calls.timeouts.acceptance_wait_s())
        self._call("upload", lambda: s3.upload_file(str(path), self.media_bucket, key, Config=transfer,
                                                    Callback=progress, ExtraArgs={"Metadata": {"sha256": sha256}}))
        return UploadReceipt(upload_id=f"s3://{self.media_bucket}/{key}")

    def create_job(self, request: JobRequest) -> Created:
        if request.inline_path is not None or not (request.upload_ref or "").startswith("s3://"):
            raise VendorError(Row(Outcome.REFUSED, False, "AWS Transcribe reads media from S3 only"),
                              operation="create_job", code="unsupported_mode")
        name = job_name(request.operation)
        options = dict(request.options or {})
        params: dict[str, Any] = {
            "TranscriptionJobName": name, "Media": {"MediaFileUri": request.upload_ref},
            "OutputBucketName": self.output_bucket, "OutputKey": self._output_key(name),
        }
        language = options.pop("language_code", None) or self.settings.get("language_code") or "en-US"
        if language == "auto":
            params["IdentifyLanguage"] = True
        else:
            params["LanguageCode"] = language
        if request.target_format in SUBTITLES:
            params["Subtitles"] = {"Formats": [request.target_format]}
        transcribe = self._client("transcribe", read_s=self.calls.timeouts.acceptance_wait_s())
        try:
            view = self._call("create_job", lambda: _job_view(
                transcribe.start_transcription_job(**params).get("TranscriptionJob") or {}, name),
                errors={"ConflictException": _CONFLICT})
        except VendorError as error:
            if error.code != "ConflictException":
                raise
            # The name is taken: our own earlier start of this operation went through.
            return Created(job=self.get_job(name), replayed=True)
        return Created(job=view)

    def get_job(self, job_id: str) -> JobView:
        transcribe = self._client("transcribe")
        return self._call("get_job", lambda: _job_view(
            transcribe.get_transcription_job(TranscriptionJobName=job_id).get("TranscriptionJob") or {}, job_id),
            errors={"BadRequestException": NOT_FOUND})

    def find_jobs(self, operation: Operation) -> list[JobView]:
        """The operation's job, found by its unique name (at most one can exist)."""
        try:
            return [self.get_job(job_name(operation))]
        except VendorError as error:
            if error.row is NOT_FOUND:
                return []
            raise

    def cancel_job(self, job_id: str) -> JobView:
        # AWS cannot stop a running job; deleting it drops the job (and frees its name).
        transcribe = self._client("transcribe")
        self._call("cancel_job", lambda: transcribe.delete_transcription_job(TranscriptionJobName=job_id),
                   errors={"BadRequestException": NOT_FOUND})
        return JobView(id=job_id, status="canceled")

    def fetch_result(self, job_id: str, dest: Path, *, target_format: str) -> FetchedResult:
        s3 = self._client("s3", read_s=self.calls.timeouts.result_s)
        key = self._output_key(job_id)
        if target_format in SUBTITLES:
            key = f"{key.removesuffix('.json')}.{target_format}"
        deadline = self.calls.wall_clock(timescale.seconds(self.calls.timeouts.result_s))

        def read() -> bytes:
            body = s3.get_object(Bucket=self.output_bucket, Key=key)["Body"]
            chunks, size = [], 0
            for chunk in body.iter_chunks(64 * 1024):
                if time.monotonic() > deadline:
                    raise DownloadDeadlineExceeded()
                size += len(chunk)
                if size > 256 * 1024 * 1024:
                    raise MalformedResponse("a transcript larger than 256 MiB")
                chunks.append(chunk)
            raw = b"".join(chunks)
            if target_format in SUBTITLES:
                return raw, "text/vtt" if target_format == "vtt" else "application/x-subrip"
            return _export(raw, target_format)

        payload, content_type = self._call("get_result", read, errors={"NoSuchKey": NOT_YET, "404": NOT_YET})
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(payload)
        return FetchedResult(sha256=hashlib.sha256(payload).hexdigest(), size=len(payload), content_type=content_type)

    def release(self, job_id: str) -> None:
        """Delete the job's media and transcript objects; the job itself stays (AWS keeps it 90
        days), so its name still refuses a late second start of the same operation."""
        job = self.get_job(job_id)
        s3 = self._client("s3")
        base = self._output_key(job_id).removesuffix(".json")
        objects = [(self.output_bucket, f"{base}.{ext}") for ext in ("json", *SUBTITLES)]
        media = urlsplit(job.natural_key)
        if media.scheme == "s3" and media.netloc == self.media_bucket and media.path.lstrip("/").startswith(
                f"{self.prefix}media/"):  # only the media Sluice uploaded
            objects.append((self.media_bucket, media.path.lstrip("/")))
        for bucket, key in objects:
            self._call("release", lambda bucket=bucket, key=key: s3.delete_object(Bucket=bucket, Key=key))

    def list_billing(self, *, cursor: str | None, limit: int) -> BillingPage:
        raise VendorError(Row(Outcome.REFUSED, False, "AWS Transcribe publishes no usage ledger (see AWS billing)"),
                          operation="usage", code="no_usage_ledger")

    def probe(self) -> None:
        transcribe = self._client("transcribe")
        self._call("probe", lambda: transcribe.list_transcription_jobs(MaxResults=1))

    def verify_callback(self, headers: Mapping[str, str], body: bytes) -> CallbackEvent:
        raise CallbackRejected(404, "not_found", "AWS Transcribe reports through EventBridge, not callbacks.")

    def _output_key(self, name: str) -> str:
        return f"{self.prefix}transcripts/{name}.json"


_CONFLICT = Row(Outcome.REFUSED, False, "AWS Transcribe already holds a job of this name")


def _client_error_row(status: int | None, code: str) -> Row:
    if code in ("ThrottlingException", "LimitExceededException", "SlowDown", "TooManyRequestsException"):
        return THROTTLED
    if code in ("InternalFailureException", "InternalError", "ServiceUnavailable"):
        return classify_status(503 if code == "ServiceUnavailable" else 500)
    if code in ("UnrecognizedClientException", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                "InvalidSignatureException"):
        return classify_status(401)
    return classify_status(status or 400)


def _job_view(job: dict[str, Any], name: str) -> JobView:
    status = job.get("TranscriptionJobStatus") or "QUEUED"  # a start's answer may not say yet
    if status not in STATUSES:
        raise MalformedResponse(f"a transcription job with status {str(status)[:20]!r}")
    failure = job.get("FailureReason")
    created = job.get("CreationTime")
    return JobView(
        id=str(job.get("TranscriptionJobName") or name), status=STATUSES[status],
        error_code="transcription_error" if status == "FAILED" else None,
        error_message=str(failure)[:300] if failure else None,
        natural_key=str((job.get("Media") or {}).get("MediaFileUri") or ""),
        created_at=created.isoformat() if hasattr(created, "isoformat") else str(created or ""),
    )


def _export(raw: bytes, target_format: str) -> tuple[bytes, str]:
    """txt: the transcript's text; json: AWS's transcript object as it is."""
    try:
        data = json.loads(raw)
        text = data["results"]["transcripts"][0]["transcript"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise MalformedResponse("a transcript object without results.transcripts[0].transcript") from None
    if not isinstance(text, str):
        raise MalformedResponse("a transcript whose text is not a string")
    if target_format == "json":
        return json.dumps(data, indent=1, sort_keys=True).encode(), "application/json"
    return (text + "\n").encode(), "text/plain; charset=utf-8"
