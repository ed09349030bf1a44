"""The tasks API (shared/contracts/tasks-api.md). Views parse input and call one service."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core import signing
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from tasks import selectors
from tasks.api.problems import problem, problem_from
from tasks.errors import FileTooLarge, InvalidRequest, NotReady, SluiceError
from tasks.models import FileVersion, InboundVendorEvent, Task, Tenant, VendorChannel, VendorJob
from tasks.scheduling.waiting import waiting_reason
from tasks.services.cancel import task_cancel
from tasks.services.intake import file_create, task_submit, validate_submission
from tasks.services.tenancy import token_authenticate
from tasks.states import State
from tasks.storage import result_file
from tasks.vendors.dialects import adapter_for
from tasks.vendors.protocol import CallbackRejected

CHUNK = 64 * 1024
SIGNER_SALT = "sluice.result-link"


def api(*methods: str) -> Callable:
    """Token auth, allowed methods, and problem+json for every refusal."""

    def decorate(view: Callable) -> Callable:
        @csrf_exempt
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                return problem(405, "method_not_allowed", f"Use {' or '.join(methods)}.")
            header = request.headers.get("Authorization", "")
            tenant = token_authenticate(header[7:].strip()) if header.startswith("Bearer ") else None
            if tenant is None:
                response = problem(401, "unauthenticated", "Send Authorization: Bearer <token> with a valid API token.")
                response["WWW-Authenticate"] = "Bearer"
                return response
            try:
                return view(request, tenant, *args, **kwargs)
            except SluiceError as error:
                return problem_from(error)

        return wrapper

    return decorate


def _json_body(request: HttpRequest) -> Any:
    if not request.content_type.startswith("application/json"):
        raise InvalidRequest("Send a JSON body with Content-Type: application/json.")
    try:
        return json.loads(request.body or b"null")
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("The body is not valid JSON.") from None


def _iso(value) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def file_json(file: FileVersion) -> dict[str, Any]:
    return {
        "id": str(file.pk), "sha256": file.sha256, "size": file.size, "detected_type": file.detected_type,
        "created_at": _iso(file.created_at), "precheck": file.precheck_state,
    }


def task_json(request: HttpRequest, task: Task) -> dict[str, Any]:
    status_url = request.build_absolute_uri(reverse("api:task", args=[task.pk]))
    result = None
    if task.state == State.SUCCEEDED:
        result = {
            "url": request.build_absolute_uri(reverse("api:task_result", args=[task.pk])),
            "sha256": task.result_sha256, "size": task.result_size, "content_type": task.result_content_type,
        }
    error = None
    if task.error_code and task.state != State.SUCCEEDED:
        error = {"code": task.error_code, "message": task.error_message, "retryable": task.error_retryable}
    return {
        "id": str(task.pk), "state": task.state, "kind": task.kind, "target_format": task.target_format,
        "priority": task.priority, "lane": task.lane_id, "file_id": str(task.file_id),
        "created_at": _iso(task.created_at), "queued_at": _iso(task.queued_at), "started_at": _iso(task.started_at),
        "finished_at": _iso(task.finished_at), "deadline_at": _iso(task.deadline_at),
        "queue_deadline_at": _iso(task.queue_deadline_at), "attempts": task.attempts,
        "waiting_reason": waiting_reason(task), "error": error, "result": result, "status_url": status_url,
        # Seconds spent in each stage of the latest attempt (null: not reached).
        "stages": {s["stage"]: s["seconds"] for s in selectors.task_stages(task=task)},
    }


@api("POST")
def files(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    length = request.META.get("CONTENT_LENGTH")
    if length and length.isdigit() and int(length) > settings.MAX_UPLOAD_BYTES + 1024 * 1024:
        raise FileTooLarge(f"The file is larger than {settings.MAX_UPLOAD_BYTES} bytes.")
    if request.content_type.startswith("multipart/form-data"):
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidRequest("Send the file in a multipart field named `file`.", field="file")
        version = file_create(tenant=tenant, chunks=upload.chunks(CHUNK), label=upload.name or "")
    elif request.content_type in ("application/octet-stream", ""):
        version = file_create(tenant=tenant, chunks=_stream(request), label=request.headers.get("X-Filename", ""))
    else:
        raise InvalidRequest(
            "Send raw bytes as application/octet-stream, or multipart/form-data with a field `file`."
        )
    response = JsonResponse(file_json(version), status=201)
    response["Location"] = request.build_absolute_uri(reverse("api:file", args=[version.pk]))
    return response


def _stream(request: HttpRequest):
    while True:
        chunk = request.read(CHUNK)
        if not chunk:
            return
        yield chunk


@api("GET")
def file_detail(request: HttpRequest, tenant: Tenant, file_id: str) -> HttpResponse:
    return JsonResponse(file_json(selectors.file_get(tenant=tenant, file_id=file_id)))


@api("GET", "POST")
def tasks(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    if request.method == "GET":
        try:
            limit = int(request.GET.get("limit", "50"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 200:
            raise InvalidRequest("limit must be an integer from 1 to 200.", field="limit")
        rows, cursor = selectors.task_list(
            tenant=tenant, state=request.GET.get("state") or None, limit=limit, cursor=request.GET.get("cursor") or None
        )
        return JsonResponse({"data": [task_json(request, t) for t in rows], "next_cursor": cursor})
    submission = validate_submission(_json_body(request))
    key = request.headers.get("Idempotency-Key")
    submitted = task_submit(tenant=tenant, request=submission, idempotency_key=key, actor=f"api tenant {tenant.name}")
    task = submitted.task
    status_url = request.build_absolute_uri(reverse("api:task", args=[task.pk]))
    body = {"id": str(task.pk), "state": task.state, "status_url": status_url, "created_at": _iso(task.created_at)}
    if task.deferred:
        # Accepted and durable, but its lane is closed to new work for now: it waits to enter.
        body["waiting_reason"] = "lane_full"
    response = JsonResponse(body, status=202)
    response["Location"] = status_url
    if submitted.replayed:
        response["Idempotent-Replayed"] = "true"
    return response


@api("GET")
def task_detail(request: HttpRequest, tenant: Tenant, task_id: str) -> HttpResponse:
    return JsonResponse(task_json(request, selectors.task_get(tenant=tenant, task_id=task_id)))


@api("GET")
def task_events(request: HttpRequest, tenant: Tenant, task_id: str) -> HttpResponse:
    task = selectors.task_get(tenant=tenant, task_id=task_id)
    events = [
        {"at": _iso(e.at), "from": e.from_state or None, "to": e.to_state or None, "actor": e.actor,
         "reason": e.reason, "generation": e.generation}
        for e in selectors.task_events(task=task)
    ]
    return JsonResponse({"data": events})


@api("POST")
def task_cancel_view(request: HttpRequest, tenant: Tenant, task_id: str) -> HttpResponse:
    task = selectors.task_get(tenant=tenant, task_id=task_id)
    outcome = task_cancel(task_id=task.pk, actor=f"api tenant {tenant.name}")
    return JsonResponse({"id": str(task.pk), "state": outcome.state}, status=202)


@api("GET")
def task_result(request: HttpRequest, tenant: Tenant, task_id: str) -> HttpResponse:
    return _result_response(selectors.task_get(tenant=tenant, task_id=task_id))


@api("POST")
def task_result_link(request: HttpRequest, tenant: Tenant, task_id: str) -> HttpResponse:
    task = selectors.task_get(tenant=tenant, task_id=task_id)
    if task.state != State.SUCCEEDED:
        raise NotReady(f"The task is {task.state}; a link can be made once it is SUCCEEDED.")
    token = signing.TimestampSigner(salt=SIGNER_SALT).sign(f"{task.pk}:{task.result_sha256}")
    ttl = int(settings.SIGNED_URL_TTL_S)
    url = request.build_absolute_uri(reverse("api:signed_result", args=[token]))
    expires = timezone.now() + timedelta(seconds=ttl)
    return JsonResponse({"url": url, "expires_at": _iso(expires)}, status=201)


@csrf_exempt
def signed_result(request: HttpRequest, token: str) -> HttpResponse:
    """An expiring link: the signature, not a token header, authorizes this one download."""
    if request.method != "GET":
        return problem(405, "method_not_allowed", "Use GET.")
    try:
        value = signing.TimestampSigner(salt=SIGNER_SALT).unsign(token, max_age=int(settings.SIGNED_URL_TTL_S))
    except signing.SignatureExpired:
        return problem(410, "link_expired", "This link expired; ask for a new one.")
    except signing.BadSignature:
        return problem(404, "not_found", "No such resource.")
    task_id, sha = value.split(":", 1)
    task = Task.objects.filter(pk=task_id, result_sha256=sha).first()
    if task is None:
        return problem(404, "not_found", "No such resource.")
    return _result_response(task)


def _result_response(task: Task) -> HttpResponse:
    if task.state != State.SUCCEEDED or not task.result_path:
        raise NotReady(f"The task is {task.state}; its result can be downloaded once it is SUCCEEDED.", state=task.state)
    path = result_file(task.result_path)
    if not path.exists():
        return problem(410, "result_expired", "The result is past its retention and was removed.")
    response = FileResponse(open(path, "rb"), content_type=task.result_content_type or "application/octet-stream")
    response["Content-Disposition"] = f'attachment; filename="{task.pk}.{task.target_format}"'
    response["X-Content-SHA256"] = task.result_sha256
    return response


@csrf_exempt
def vendor_callback(request: HttpRequest, channel_name: str) -> HttpResponse:
    """A vendor's authenticated job event (each dialect says how it authenticates): shortens the
    wait for the next poll. Polling stays the truth."""
    if request.method != "POST":
        return problem(405, "method_not_allowed", "Use POST.")
    channel = VendorChannel.objects.filter(pk=channel_name).first()
    if channel is None:
        return problem(404, "not_found", "No such channel.")
    try:
        event = adapter_for(channel).verify_callback(request.headers, request.body)
    except CallbackRejected as rejected:
        return problem(rejected.status, rejected.code, rejected.detail)
    event_id, job_id = event.event_id, event.job_id
    _, created = InboundVendorEvent.objects.get_or_create(channel=channel, event_id=event_id[:100], defaults={"job_id": job_id[:100]})
    if created:
        job = VendorJob.objects.filter(channel=channel, vendor_job_id=job_id).first()
        if job is not None:
            Task.objects.filter(pk=job.task_id, state=State.RUNNING, phase=Task.Phase.POLL, vendor_job=job).update(
                due_at=timezone.now()
            )
    return JsonResponse({"received": True, "duplicate": not created})


def openapi(request: HttpRequest) -> HttpResponse:
    from tasks.api.openapi import document

    return JsonResponse(document(request.build_absolute_uri("/")))
