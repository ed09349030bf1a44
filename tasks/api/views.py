"""The tasks API (shared/contracts/tasks-api.md), declared once with django-ninja: each operation's
parameters and bodies are pydantic declarations (tasks/api/schemas.py) that both validate the
request and generate the OpenAPI document at /api/v1/openapi.json. Views call one service each;
every refusal is problem+json with a stable code."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core import signing
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.urls import get_script_prefix, reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from ninja import Body, Header, NinjaAPI, Path, Query, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer
from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from tasks import safejson, selectors
from tasks.api import schemas
from tasks.api.bodies import MAX_LABEL, body_chunks, body_read, drain, upload_label
from tasks.api.problems import problem, problem_from, validation_detail, validation_problem
from tasks.api.results import result_response
from tasks.errors import (
    FileTooLarge,
    InvalidJson,
    InvalidMultipart,
    InvalidRequest,
    NotReady,
    SluiceError,
)
from tasks.models import FileVersion, InboundVendorEvent, Task, Tenant, VendorChannel, VendorJob
from tasks.scheduling.waiting import waiting_reason
from tasks.services.cancel import task_cancel
from tasks.services.intake import SubmitRequest, file_create, task_submit, task_submit_batch
from tasks.services.tenancy import token_authenticate
from tasks.states import State
from tasks.vendors.dialects import adapter_for
from tasks.vendors.protocol import CallbackRejected

CHUNK = 64 * 1024
SIGNER_SALT = "sluice.result-link"
MAX_JSON_BYTES = 1024 * 1024


class TenantToken(HttpBearer):
    """`Authorization: Bearer <token>`; the token is never logged."""

    def __call__(self, request: HttpRequest) -> Tenant | None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Tenant | None:
        return token_authenticate(token)


class BoundedJson(Parser):
    """JSON bodies: `application/json` only, at most 1 MB, nested at most 32 levels."""

    def parse_body(self, request: HttpRequest) -> Any:
        if request.content_type != "application/json":
            raise InvalidRequest("Send a JSON body with Content-Type: application/json.")
        raw = body_read(request, limit=MAX_JSON_BYTES)
        try:
            return safejson.loads(raw or b"null")
        except safejson.JsonRefused as refused:
            raise InvalidJson(str(refused)) from None


class SluiceApi(NinjaAPI):
    def get_openapi_schema(self, *, path_prefix: str | None = None, path_params: dict | None = None):
        from tasks.api.document import refine

        return refine(super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params))


api = SluiceApi(
    title="Sluice tasks API", version="1.0.0", urls_namespace="api", docs_url=None, openapi_url=None, auth=TenantToken(),
    parser=BoundedJson(),
    description="Upload files, submit tasks (202 Accepted), follow, cancel and download results. "
                "Errors are application/problem+json with a stable `code`.",
)


@api.exception_handler(SluiceError)
def _sluice_error(request: HttpRequest, error: SluiceError) -> HttpResponse:
    return problem_from(error)


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, error: ValidationError) -> HttpResponse:
    return validation_problem(error.errors)


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, error: AuthenticationError) -> HttpResponse:
    response = problem(401, "unauthenticated", "Send Authorization: Bearer <token> with a valid API token.")
    response["WWW-Authenticate"] = "Bearer"
    return response


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, error: HttpError) -> HttpResponse:
    # django-ninja wraps what the body parser raised; the parser's own refusal says more.
    if isinstance(error.__cause__, SluiceError):
        return problem_from(error.__cause__)
    return problem(error.status_code, "invalid_request", str(error))


@api.exception_handler(RequestDataTooBig)
def _too_big(request: HttpRequest, error: RequestDataTooBig) -> HttpResponse:
    drain(request)
    return problem(413, "payload_too_large", f"The body is larger than {MAX_JSON_BYTES} bytes.")


def _problems(*statuses: int) -> dict[int, type]:
    """The problem answers an operation may give, besides 401 (tasks/api/document.py lists the
    codes each status carries)."""
    return {status: schemas.Problem for status in statuses}


def _iso(value) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def file_json(file: FileVersion) -> dict[str, Any]:
    return {
        "id": str(file.pk), "sha256": file.sha256, "size": file.size, "detected_type": file.detected_type,
        "created_at": _iso(file.created_at), "precheck": file.precheck_state,
    }


_PLACEHOLDER = "00000000-0000-0000-0000-000000000000"
_task_paths: dict[str, str] = {}


def task_status_url(request: HttpRequest, task_id: Any) -> str:
    """A task's status URL. Its path is resolved once for each script prefix the site is served
    under (resolving it cost a submission's answer more than the rest of the answer did)."""
    prefix = get_script_prefix()
    path = _task_paths.get(prefix)
    if path is None:
        path = _task_paths[prefix] = reverse("api:task", args=[_PLACEHOLDER]).removesuffix(_PLACEHOLDER)
    return request.build_absolute_uri(f"{path}{task_id}")


def task_json(request: HttpRequest, task: Task) -> dict[str, Any]:
    status_url = task_status_url(request, task.pk)
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
        "stages": {s["stage"]: s["seconds"] for s in selectors.task_stages(task=task)},
    }


# --- files ---------------------------------------------------------------------------------------

UPLOAD_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"],
                                       "properties": {"file": {"type": "string", "format": "binary"}}}},
}}}


@api.post("/files", url_name="files", operation_id="uploadFile", summary="Store an immutable file version",
          response={201: schemas.FileOut, **_problems(400, 413, 415, 429)}, openapi_extra=UPLOAD_BODY)
def files(request: HttpRequest, response: HttpResponse,
          x_filename: str = Header("", alias="X-Filename", max_length=MAX_LABEL,
                                   description="Display label only; never used to build a path.")):
    """Raw bytes (`application/octet-stream`, chunked transfer allowed) or `multipart/form-data`
    with a field `file`. The upload streams to disk: memory does not grow with the file."""
    tenant: Tenant = request.auth
    length = request.META.get("CONTENT_LENGTH")
    if length and length.isdigit() and int(length) > settings.MAX_UPLOAD_BYTES + 1024 * 1024:
        raise FileTooLarge(f"The file is larger than {settings.MAX_UPLOAD_BYTES} bytes.")
    if request.content_type == "multipart/form-data":
        version = file_create(tenant=tenant, chunks=_multipart_file(request).chunks(CHUNK), label=_multipart_label(request))
    elif request.content_type in ("application/octet-stream", ""):
        version = file_create(tenant=tenant, chunks=body_chunks(request, CHUNK), label=x_filename)
    else:
        raise InvalidRequest("Send raw bytes as application/octet-stream, or multipart/form-data with a field `file`.")
    response["Location"] = request.build_absolute_uri(reverse("api:file", args=[version.pk]))
    return Status(201, file_json(version))


def _multipart_file(request: HttpRequest):
    if getattr(request, "sluice_chunked", False):
        raise InvalidMultipart("A multipart upload needs a Content-Length; send raw bytes as "
                               "application/octet-stream to stream without one.")
    try:
        upload = request.FILES.get("file")
    except MultiPartParserError as error:
        raise InvalidMultipart(f"The multipart body cannot be parsed: {error}.") from None
    if upload is None:
        raise InvalidRequest("Send the file in a multipart field named `file`.", field="file")
    return upload


def _multipart_label(request: HttpRequest) -> str:
    label = upload_label(request.FILES["file"])
    if len(label) > MAX_LABEL:
        raise InvalidRequest(f"The file name is longer than {MAX_LABEL} characters.", field="file")
    return label


@api.get("/files/{file_id}", url_name="file", operation_id="getFile",
         response={200: schemas.FileOut, **_problems(400, 404)})
def file_detail(request: HttpRequest, file_id: str = Path(..., max_length=100)):
    return file_json(selectors.file_get(tenant=request.auth, file_id=file_id))


# --- tasks ---------------------------------------------------------------------------------------

@api.post("/tasks", url_name="tasks", operation_id="submitTask",
          summary="Submit a task; 202 means accepted and durable, not done",
          response={202: schemas.Accepted, **_problems(400, 404, 409, 413, 422, 429, 503)},
          exclude_none=True)
def task_submit_view(request: HttpRequest, body: schemas.Submission = Body(...),
                     idempotency_key: str | None = Header(
                         None, alias="Idempotency-Key", min_length=1, max_length=255,
                         description="Makes the submission safe to retry: the same key with the same request replays "
                                     "its task, with another request it is 422, while the first is still being "
                                     "accepted 409. A key is kept 48 hours; after that it makes a new task.")):
    tenant: Tenant = request.auth
    submitted = task_submit(tenant=tenant, request=body.to_request(), idempotency_key=idempotency_key,
                            actor=f"api tenant {tenant.name}")
    task = submitted.task
    status_url = task_status_url(request, task.pk)
    answer = {"id": str(task.pk), "state": task.state, "status_url": status_url, "created_at": _iso(task.created_at)}
    if task.deferred:
        answer["waiting_reason"] = "lane_full"  # accepted and durable, but its lane is closed to new work for now
    # Written as schemas.Accepted documents it, without validating what this code built: the
    # API's busiest answer, and ninja's validation of it held about 7 % of a submission's samples.
    response = JsonResponse(answer, status=202, content_type="application/json; charset=utf-8")
    response["Location"] = status_url
    if submitted.replayed:
        response["Idempotent-Replayed"] = "true"
    return response


@api.post("/tasks/batch", url_name="tasks_batch", operation_id="submitTaskBatch",
          summary="Submit up to 500 tasks in one request; each is answered on its own",
          response={200: schemas.BatchOut, **_problems(400, 413)}, exclude_none=True)
def task_batch_view(request: HttpRequest, body: schemas.BatchSubmission = Body(...)):
    """Each item is accepted durably (as a 202 of submitTask would be), replayed by its
    idempotency_key, or refused with the problem code a single submission would get; never half
    written. The answer lists every item in request order."""
    tenant: Tenant = request.auth
    outcomes = task_submit_batch(tenant=tenant, items=[_batch_item(item) for item in body.items],
                                 actor=f"api tenant {tenant.name}")
    # Every item's status URL is this one with its id (built once, not for each item).
    status_url = task_status_url(request, "")
    data = []
    for index, outcome in enumerate(outcomes):
        if outcome.error is not None:
            error = outcome.error
            data.append({"index": index, "status": error.status, "code": error.code, "detail": error.detail,
                         "field": error.extra.get("field")})
            continue
        task = outcome.submitted.task
        data.append({"index": index, "status": 202, "id": str(task.pk), "state": task.state,
                     "status_url": f"{status_url}{task.pk}",
                     "created_at": _iso(task.created_at), "replayed": outcome.submitted.replayed,
                     "waiting_reason": "lane_full" if task.deferred else None})
    replayed = sum(1 for o in outcomes if o.submitted is not None and o.submitted.replayed)
    refused = sum(1 for o in outcomes if o.error is not None)
    return {"data": data, "accepted": len(outcomes) - refused - replayed, "replayed": replayed, "refused": refused}


_SUBMISSION = TypeAdapter(schemas.Submission)


def _batch_item(item: dict[str, Any]) -> tuple[SubmitRequest | SluiceError, str | None]:
    """One batch item as a submission and its key, or the refusal it gets."""
    item = dict(item)
    key = item.pop("idempotency_key", None)
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= 255):
        return InvalidRequest("idempotency_key must be 1 to 255 characters.", field="idempotency_key"), None
    try:
        return _SUBMISSION.validate_python(item).to_request(), key
    except PydanticValidationError as error:
        detail, field = validation_detail(error.errors())
        return InvalidRequest(detail, field=field), key


@api.get("/tasks", operation_id="listTasks", response={200: schemas.TaskPage, **_problems(400)})
def task_list_view(request: HttpRequest,
                   state: str | None = Query(None, pattern=schemas.STATE_LIST, description="One state or several, comma-separated."),
                   limit: int = Query(50, ge=1, le=200),
                   cursor: str | None = Query(None, max_length=200, pattern=r"^[A-Za-z0-9_-]+$",
                                              description="next_cursor of the previous page.")):
    """A page of the tenant's tasks, newest first."""
    rows, next_cursor = selectors.task_list(tenant=request.auth, state=state, limit=limit, cursor=cursor)
    return {"data": [task_json(request, t) for t in rows], "next_cursor": next_cursor}


TaskId = Path(..., max_length=100)


@api.get("/tasks/{task_id}", url_name="task", operation_id="getTask",
         response={200: schemas.TaskOut, **_problems(400, 404)})
def task_detail(request: HttpRequest, task_id: str = TaskId):
    return task_json(request, selectors.task_get(tenant=request.auth, task_id=task_id))


@api.get("/tasks/{task_id}/events", url_name="task_events", operation_id="getTaskEvents",
         response={200: schemas.EventPage, **_problems(400, 404)}, by_alias=True)
def task_events(request: HttpRequest, task_id: str = TaskId):
    task = selectors.task_get(tenant=request.auth, task_id=task_id)
    return {"data": [
        {"at": _iso(e.at), "from": e.from_state or None, "to": e.to_state or None, "actor": e.actor,
         "reason": e.reason, "generation": e.generation}
        for e in selectors.task_events(task=task)
    ]}


@api.post("/tasks/{task_id}/cancel", url_name="task_cancel", operation_id="cancelTask",
          response={202: schemas.CancelOut, **_problems(400, 404, 409)})
def task_cancel_view(request: HttpRequest, task_id: str = TaskId):
    """CANCELLED at once for work not yet running, CANCEL_REQUESTED while the vendor is asked to stop."""
    task = selectors.task_get(tenant=request.auth, task_id=task_id)
    outcome = task_cancel(task_id=task.pk, actor=f"api tenant {request.auth.name}")
    return Status(202, {"id": str(task.pk), "state": outcome.state})


BINARY = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "headers": {"X-Content-SHA256": {"schema": {"type": "string"}}, "Content-Disposition": {"schema": {"type": "string"}}}}


@api.get("/tasks/{task_id}/result", url_name="task_result", operation_id="getTaskResult",
         response={200: None, **_problems(400, 404, 409, 410)},
         openapi_extra={"responses": {200: {"description": "The result bytes", **BINARY}}})
def task_result(request: HttpRequest, task_id: str = TaskId):
    return result_response(selectors.task_get(tenant=request.auth, task_id=task_id))


@api.post("/tasks/{task_id}/result-link", url_name="task_result_link", operation_id="createResultLink",
          response={201: schemas.ResultLink, **_problems(400, 404, 409)})
def task_result_link(request: HttpRequest, task_id: str = TaskId):
    """An expiring signed link to the result, to hand to someone without a token."""
    task = selectors.task_get(tenant=request.auth, task_id=task_id)
    if task.state != State.SUCCEEDED:
        raise NotReady(f"The task is {task.state}; a link can be made once it is SUCCEEDED.")
    token = signing.TimestampSigner(salt=SIGNER_SALT).sign(f"{task.pk}:{task.result_sha256}")
    url = request.build_absolute_uri(reverse("api:signed_result", args=[token]))
    expires = timezone.now() + timedelta(seconds=int(settings.SIGNED_URL_TTL_S))
    return Status(201, {"url": url, "expires_at": _iso(expires)})


@api.get("/results/{token}", url_name="signed_result", operation_id="getSignedResult", auth=None,
         response={200: None, **_problems(400, 404, 409, 410)},
         openapi_extra={"responses": {200: {"description": "The result bytes", **BINARY}}, "security": []})
def signed_result(request: HttpRequest, token: str = Path(..., max_length=300, pattern=r"^[A-Za-z0-9_:\-]+$")):
    """An expiring link: the signature, not a token header, authorizes this one download."""
    try:
        value = signing.TimestampSigner(salt=SIGNER_SALT).unsign(token, max_age=int(settings.SIGNED_URL_TTL_S))
    except signing.SignatureExpired:
        return problem(410, "link_expired", "This link expired; ask for a new one.")
    except signing.BadSignature:
        return problem(404, "not_found", "No such resource.")
    task_id, _, sha = value.partition(":")
    task = Task.objects.filter(pk=task_id, result_sha256=sha).first()
    if task is None:
        return problem(404, "not_found", "No such resource.")
    return result_response(task)


# --- vendors -------------------------------------------------------------------------------------

CALLBACK_BODY = {"requestBody": {"required": True, "description": "The vendor's event, in its dialect; "
                                 "authenticated as the dialect says (a signature header or a shared secret).",
                                 "content": {"application/json": {"schema": {"type": "object"}}}},
                 "security": []}


@api.post("/vendor-callbacks/{channel_name}", url_name="vendor_callback", operation_id="vendorCallback", auth=None,
          response={200: schemas.CallbackReceived, **_problems(400, 401, 404, 413)},
          openapi_extra=CALLBACK_BODY)
def vendor_callback(request: HttpRequest, channel_name: str = Path(..., max_length=32, pattern=r"^[-a-zA-Z0-9_]+$")):
    """A vendor's authenticated job event: shortens the wait for the next poll. Polling stays the truth."""
    channel = VendorChannel.objects.filter(pk=channel_name).first()
    if channel is None:
        return problem(404, "not_found", "No such channel.")
    body = body_read(request, limit=MAX_JSON_BYTES)
    try:
        event = adapter_for(channel).verify_callback(request.headers, body)
    except CallbackRejected as rejected:
        return problem(rejected.status, rejected.code, rejected.detail)
    _, created = InboundVendorEvent.objects.get_or_create(channel=channel, event_id=event.event_id[:100],
                                                          defaults={"job_id": event.job_id[:100]})
    if created:
        job = VendorJob.objects.filter(channel=channel, vendor_job_id=event.job_id).first()
        if job is not None:
            Task.objects.filter(pk=job.task_id, state=State.RUNNING, phase=Task.Phase.POLL, vendor_job=job).update(
                due_at=timezone.now())
    return {"received": True, "duplicate": not created}


@csrf_exempt
def openapi(request: HttpRequest) -> HttpResponse:
    """The OpenAPI document, generated from the declarations above."""
    if request.method != "GET":
        return HttpResponseNotAllowed(["GET"])
    return JsonResponse(api.get_openapi_schema(path_prefix=reverse("api:files").rsplit("files", 1)[0]))
