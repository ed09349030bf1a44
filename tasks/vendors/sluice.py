"""The `sluice` dialect: the vendor contract in shared/contracts/vendor-api.md.

A cooperative vendor: it honours Idempotency-Key (a resend with the same key is replayed, not
billed), lists jobs by our client_ref (reconciliation and duplicate audits), cancels, signs its
callbacks (HMAC-SHA256 of the body), declares result and input digests, and publishes a usage
ledger. Two upload modes: two-step (POST /v1/uploads, then a job) and inline (the file is the
body of the create).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tasks import safejson, timescale
from tasks.models import VendorChannel
from tasks.vendors.capabilities import Capabilities
from tasks.vendors.errors import MalformedResponse
from tasks.vendors.http import VendorHttp, cursor_value, download_to, json_object, problem_details
from tasks.vendors.protocol import (
    JOB_STATUSES,
    BillingEntry,
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
    idempotency_key=True, reconcile_by="client_ref", cancel=True, callbacks=True, reports_input_digest=True,
    result="download", billing_ledger=True, kinds=frozenset({"transcription", "conversion"}),
    upload_modes=frozenset({"two_step", "inline"}),
)


class SluiceAdapter:
    capabilities = CAPABILITIES

    def __init__(self, channel: VendorChannel, *, task_id: Any = None, generation: int | None = None,
                 deadline: datetime | None = None) -> None:
        self.channel = channel
        self.capabilities = CAPABILITIES.narrowed(channel.capability_overrides)
        self.http = VendorHttp(channel, task_id=task_id, generation=generation, deadline=deadline,
                               auth_headers={"Authorization": f"Bearer {channel.api_key}"}, error_details=problem_details)

    def upload(self, path: Path, *, size: int, sha256: str, operation: Operation,
               on_chunk: Callable[[int], None] | None = None) -> UploadReceipt:
        # X-Client-Ref is not part of the contract; it only lets a vendor's logs tie the upload to the job.
        headers = {"X-Client-Ref": operation.client_ref} if operation.client_ref else None
        return self.http.send_file("upload", "POST", "/v1/uploads", path, size=size, sha256=sha256, on_chunk=on_chunk,
                                   headers=headers, parse=_upload_receipt)

    def create_job(self, request: JobRequest) -> Created:
        headers = {"Idempotency-Key": request.operation.idempotency_key}
        if request.inline_path is not None:
            params = {"kind": request.kind, "target_format": request.target_format,
                      "client_ref": request.operation.client_ref}
            if request.options:
                params["options"] = json.dumps(request.options, sort_keys=True)
            if request.callback_url:
                params["callback_url"] = request.callback_url
            return self.http.send_file(
                "create_job", "POST", "/v1/jobs", request.inline_path, size=request.size, sha256=request.sha256,
                on_chunk=request.on_chunk, params=params, headers=headers, parse=_created,
            )
        body: dict[str, Any] = {
            "upload_id": request.upload_ref, "kind": request.kind, "target_format": request.target_format,
            "client_ref": request.operation.client_ref, "options": request.options or {},
        }
        if request.callback_url:
            body["callback_url"] = request.callback_url
        return self.http.call(
            "create_job", "POST", "/v1/jobs", json=body, headers=headers,
            timeout=self.http.timeout(self.http.timeouts.acceptance_wait_s()), parse=_created,
        )

    def get_job(self, job_id: str) -> JobView:
        return self.http.call("get_job", "GET", f"/v1/jobs/{job_id}", parse=_job)

    def find_jobs(self, operation: Operation) -> list[JobView]:
        jobs: list[JobView] = []
        cursor = None
        for _ in range(50):
            params: dict[str, Any] = {"client_ref": operation.client_ref, "limit": 100}
            if cursor:
                params["cursor"] = cursor
            page = self.http.call("list_jobs", "GET", "/v1/jobs", params=params, parse=_job_page)
            jobs.extend(page[0])
            cursor = page[1]
            if not cursor:
                break
        return jobs

    def cancel_job(self, job_id: str) -> JobView:
        return self.http.call("cancel_job", "POST", f"/v1/jobs/{job_id}/cancel", parse=_job)

    def release(self, job_id: str) -> None:
        return None  # the native contract keeps a job's data under the vendor's own retention

    def fetch_result(self, job_id: str, dest: Path, *, target_format: str) -> FetchedResult:
        """Stream a result to `dest`, hashing as it arrives; memory does not grow with size."""
        return self.http.call(
            "get_result", "GET", f"/v1/jobs/{job_id}/result",
            timeout=self.http.timeout(self.http.timeouts.result_s),
            consume=download_to(dest, deadline=self.http.wall_clock(timescale.seconds(self.http.timeouts.result_s))),
        )

    def list_billing(self, *, cursor: str | None, limit: int) -> BillingPage:
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        return self.http.call("usage", "GET", "/v1/usage", params=params, parse=_billing_page)

    def probe(self) -> None:
        self.http.call("probe", "GET", "/v1/jobs", params={"client_ref": "sluice-probe", "limit": 1})

    def verify_callback(self, headers: Mapping[str, str], body: bytes) -> CallbackEvent:
        secret = self.channel.webhook_secret
        if not secret:
            raise CallbackRejected(404, "not_found", "No such channel.")
        expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, headers.get("X-Vendor-Signature", "")):
            raise CallbackRejected(401, "bad_signature", "The signature does not match.")
        try:
            event = safejson.loads(body)  # bounded depth: a signed but hostile body is refused, not crashed on
            return CallbackEvent(event_id=str(event["event_id"])[:100], job_id=str(event["job"]["id"])[:100])
        except (ValueError, KeyError, TypeError):
            raise CallbackRejected(400, "invalid_request", "Expected {event, event_id, job: {id}}.") from None


def job_view(data: Any) -> JobView:
    """A job object as the contract defines it; MalformedResponse when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not data["id"]:
        raise MalformedResponse("a job without an id")
    if data.get("status") not in JOB_STATUSES:
        raise MalformedResponse(f"a job with status {str(data.get('status'))[:20]!r}")
    result = data.get("result") or {}
    error = data.get("error") or {}
    billing = data.get("billing") or {}
    if not all(isinstance(part, dict) for part in (result, error, billing, data.get("input") or {})):
        raise MalformedResponse("a job whose result, error, input or billing is not an object")
    return JobView(
        id=data["id"], status=data["status"], client_ref=str(data.get("client_ref") or ""),
        input_sha256=str((data.get("input") or {}).get("sha256") or ""),
        result_sha256=result.get("sha256"), result_size=result.get("size"), result_content_type=result.get("content_type"),
        error_code=error.get("code"), error_message=error.get("message"), error_retryable=bool(error.get("retryable", False)),
        billing_units=billing.get("units"), billing_unit=billing.get("unit"), amount_cents=billing.get("amount_cents"),
        created_at=str(data.get("created_at") or ""),
    )


def _job(response: httpx.Response) -> JobView:
    return job_view(json_object(response))


def _created(response: httpx.Response) -> Created:
    return Created(job=_job(response), replayed=response.headers.get("Idempotent-Replayed", "").lower() == "true")


def _upload_receipt(response: httpx.Response) -> UploadReceipt:
    data = json_object(response)
    if not isinstance(data.get("upload_id"), str) or not data["upload_id"]:
        raise MalformedResponse("an upload answer without an upload_id")
    expires = data.get("expires_at")
    return UploadReceipt(upload_id=data["upload_id"], expires_at=expires if isinstance(expires, str) else None)


def _job_page(response: httpx.Response) -> tuple[list[JobView], str | None]:
    data = json_object(response)
    if not isinstance(data.get("data"), list):
        raise MalformedResponse("a job list without a data list")
    return [job_view(item) for item in data["data"]], cursor_value(data.get("next_cursor"))


def _billing_page(response: httpx.Response) -> BillingPage:
    data = json_object(response)
    entries = data.get("data")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("entry_id") for e in entries):
        raise MalformedResponse("a usage page without a data list of entries")
    try:
        parsed = [
            BillingEntry(
                entry_id=str(e["entry_id"]), job_id=str(e.get("job_id") or ""), client_ref=str(e.get("client_ref") or ""),
                idempotency_key=str(e.get("idempotency_key") or ""), units=float(e.get("units") or 0),
                unit=str(e.get("unit") or ""), amount_cents=int(e.get("amount_cents") or 0),
                created_at=str(e.get("created_at") or ""),
            )
            for e in entries
        ]
    except (TypeError, ValueError):
        raise MalformedResponse("a usage entry with units or amount that are not numbers") from None
    return BillingPage(entries=parsed, next_cursor=cursor_value(data.get("next_cursor")))
