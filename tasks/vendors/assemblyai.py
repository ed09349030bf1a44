"""The `assemblyai` dialect: AssemblyAI's v2 REST API, as its vendor publishes it.

`POST /v2/upload` (raw bytes → `upload_url`), `POST /v2/transcript` (`audio_url`, `webhook_url`,
`webhook_auth_header_name/value`), `GET /v2/transcript/{id}` (status queued | processing |
completed | error), `GET /v2/transcript` (paged, newest first), `DELETE /v2/transcript/{id}`,
`GET /v2/transcript/{id}/srt|vtt`, and the transcript's `text` for txt. The API key goes in the
`Authorization` header as it is (no "Bearer"); errors are `{"error": "..."}` and are classified by
status with the one table.

What this vendor does not do shapes how Sluice uses it (see capabilities): no idempotency key and
no client reference, so a create whose answer is lost is reconciled by listing recent transcripts
and matching the `audio_url`, which is the unique URL of our own upload (before any DELETE, which
replaces it with "http://deleted_by_user"); no way to stop a running transcript (DELETE drops a
finished one's data); results are rendered on demand with no digest to check; no usage ledger.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from tasks import safejson, timescale
from tasks.models import VendorChannel
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.classification import Outcome, Row
from tasks.vendors.errors import MalformedResponse, VendorError
from tasks.vendors.http import VendorHttp, download_to, json_object
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
    idempotency_key=False, reconcile_by="natural_key", cancel=False, callbacks=True, reports_input_digest=False,
    result="export", billing_ledger=False, kinds=frozenset({"transcription"}), upload_modes=frozenset({"two_step"}),
)
STATUSES = {"queued": "queued", "processing": "processing", "completed": "completed", "error": "failed"}
SUBTITLES = ("srt", "vtt")
# The header AssemblyAI is asked to send with its webhooks, carrying the channel's secret.
WEBHOOK_HEADER = "X-Sluice-Webhook-Secret"
LIST_PAGE = 200
# How far back reconciliation looks for our upload's transcript (pages of LIST_PAGE, newest first).
LIST_PAGES = 20


class AssemblyAIAdapter:
    capabilities = CAPABILITIES

    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                 deadline: datetime | None = None) -> None:
        self.channel = channel
        self.capabilities = CAPABILITIES.narrowed(channel.capability_overrides)
        self.http = VendorHttp(channel, task_id=task_id, generation=generation, deadline=deadline,
                               auth_headers={"Authorization": channel.api_key}, error_details=error_details)

    def upload(self, path: Path, *, size: int, sha256: str, operation: Operation,
               on_chunk: Callable[[int], None] | None = None) -> UploadReceipt:
        return self.http.send_file("upload", "POST", "/v2/upload", path, size=size, sha256=sha256, on_chunk=on_chunk,
                                   parse=_upload_receipt)

    def create_job(self, request: JobRequest) -> Created:
        if request.inline_path is not None or not request.upload_ref:
            raise VendorError(Row(Outcome.REFUSED, False, "AssemblyAI takes a file only through POST /v2/upload"),
                              operation="create_job", code="unsupported_mode")
        body: dict[str, Any] = {**(request.options or {}), "audio_url": request.upload_ref}
        if request.callback_url and self.channel.webhook_secret:
            body.update(webhook_url=request.callback_url, webhook_auth_header_name=WEBHOOK_HEADER,
                        webhook_auth_header_value=self.channel.webhook_secret)
        return self.http.call(
            "create_job", "POST", "/v2/transcript", json=body,
            timeout=self.http.timeout(self.http.timeouts.acceptance_wait_s()),
            parse=lambda response: Created(job=transcript_view(json_object(response))),
        )

    def get_job(self, job_id: str) -> JobView:
        return self.http.call("get_job", "GET", f"/v2/transcript/{job_id}",
                              parse=lambda response: transcript_view(json_object(response)))

    def find_jobs(self, operation: Operation) -> list[JobView]:
        """Transcripts of our upload (its URL is unique), newest first, paging to older ones."""
        if not operation.upload_ref:
            return []
        found: list[JobView] = []
        before_id = None
        for _ in range(LIST_PAGES):
            params: dict[str, Any] = {"limit": LIST_PAGE}
            if before_id:
                params["before_id"] = before_id
            items, before_id = self.http.call("list_jobs", "GET", "/v2/transcript", params=params, parse=_transcript_page)
            found += [item for item in items if item.natural_key == operation.upload_ref]
            if not before_id:
                break
        return found

    def cancel_job(self, job_id: str) -> JobView:
        # AssemblyAI cannot stop a transcript; DELETE drops a finished one's data (and its audio_url).
        return self.http.call("cancel_job", "DELETE", f"/v2/transcript/{job_id}",
                              parse=lambda response: transcript_view(json_object(response)))

    def release(self, job_id: str) -> None:
        return None  # a transcript is deleted only by an explicit cancel of an unwanted job

    def fetch_result(self, job_id: str, dest: Path, *, target_format: str) -> FetchedResult:
        timeout = self.http.timeout(self.http.timeouts.result_s)
        if target_format in SUBTITLES:
            deadline = self.http.wall_clock(timescale.seconds(self.http.timeouts.result_s))
            return self.http.call("get_result", "GET", f"/v2/transcript/{job_id}/{target_format}", timeout=timeout,
                                  consume=download_to(dest, deadline=deadline))
        return self.http.call("get_result", "GET", f"/v2/transcript/{job_id}", timeout=timeout,
                              parse=lambda response: _write_export(response, dest, target_format))

    def list_billing(self, *, cursor: str | None, limit: int) -> BillingPage:
        raise VendorError(Row(Outcome.REFUSED, False, "AssemblyAI publishes no usage ledger"), operation="usage",
                          code="no_usage_ledger")

    def probe(self) -> None:
        self.http.call("probe", "GET", "/v2/transcript", params={"limit": 1})

    def verify_callback(self, headers: Mapping[str, str], body: bytes) -> CallbackEvent:
        secret = self.channel.webhook_secret
        if not secret:
            raise CallbackRejected(404, "not_found", "No such channel.")
        if not hmac.compare_digest(secret.encode(), headers.get(WEBHOOK_HEADER, "").encode()):
            raise CallbackRejected(401, "bad_signature", f"The {WEBHOOK_HEADER} header does not match.")
        try:
            event = safejson.loads(body)  # bounded depth: a signed but hostile body is refused, not crashed on
            transcript_id, status = str(event["transcript_id"]), str(event["status"])
        except (ValueError, KeyError, TypeError):
            raise CallbackRejected(400, "invalid_request", "Expected {transcript_id, status}.") from None
        return CallbackEvent(event_id=f"{transcript_id}:{status}"[:100], job_id=transcript_id[:100])


def error_details(response: httpx.Response) -> tuple[str | None, str]:
    """AssemblyAI's errors are `{"error": "..."}` with no code: the status classifies them."""
    try:
        body = response.json()
    except ValueError:
        return None, ""
    message = body.get("error") if isinstance(body, dict) else None
    return None, message[:200] if isinstance(message, str) else ""


def transcript_view(data: dict[str, Any]) -> JobView:
    """A Transcript (or a TranscriptListItem) as a JobView."""
    transcript_id, status = data.get("id"), data.get("status")
    if not isinstance(transcript_id, str) or not transcript_id or status not in STATUSES:
        raise MalformedResponse(f"a transcript with id {str(transcript_id)[:40]!r} and status {str(status)[:20]!r}")
    audio_url = data.get("audio_url")
    if not isinstance(audio_url, str):
        raise MalformedResponse("a transcript without an audio_url")
    error = data.get("error") if status == "error" else None
    duration = data.get("audio_duration")
    minutes = -(-int(duration) // 60) if isinstance(duration, (int, float)) and duration > 0 else None
    return JobView(
        id=transcript_id, status=STATUSES[status], natural_key=audio_url,
        error_code="transcription_error" if status == "error" else None,
        error_message=str(error)[:300] if error else None,
        billing_units=float(minutes) if minutes else None, billing_unit="audio_minute" if minutes else None,
        created_at=str(data.get("created") or ""),
    )


def _upload_receipt(response: httpx.Response) -> UploadReceipt:
    data = json_object(response)
    if not isinstance(data.get("upload_url"), str) or not data["upload_url"]:
        raise MalformedResponse("an upload answer without an upload_url")
    return UploadReceipt(upload_id=data["upload_url"])


def _transcript_page(response: httpx.Response) -> tuple[list[JobView], str | None]:
    """One page of GET /v2/transcript, and the before_id of the next older page (from prev_url)."""
    data = json_object(response)
    items, details = data.get("transcripts"), data.get("page_details")
    if not isinstance(items, list) or not isinstance(details, dict):
        raise MalformedResponse("a transcript list without transcripts and page_details")
    older = details.get("prev_url")
    before_id = None
    if isinstance(older, str) and older:
        before_id = (parse_qs(urlsplit(older).query).get("before_id") or [None])[0]
    return [transcript_view(item) for item in items if isinstance(item, dict)], before_id


def _write_export(response: httpx.Response, dest: Path, target_format: str) -> FetchedResult:
    """txt is the transcript's `text`; json is the transcript object itself."""
    data = json_object(response)
    if target_format == "json":
        payload, content_type = json.dumps(data, indent=1, sort_keys=True).encode(), "application/json"
    else:
        text = data.get("text")
        if not isinstance(text, str):
            raise MalformedResponse("a completed transcript without its text")
        payload, content_type = (text + "\n").encode(), "text/plain; charset=utf-8"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(payload)
    return FetchedResult(sha256=hashlib.sha256(payload).hexdigest(), size=len(payload), content_type=content_type)
