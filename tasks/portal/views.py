"""Forms for business users: log in, upload, follow tasks, cancel, download. Same services as the API."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from tasks import selectors, wording
from tasks.api.bodies import upload_label
from tasks.api.results import result_filename, result_response
from tasks.errors import SluiceError
from tasks.portal.forms import SubmitForm
from tasks.scheduling.waiting import waiting_reason
from tasks.services.cancel import task_cancel
from tasks.services.intake import SubmitRequest, file_create, task_submit
from tasks.services.tenancy import tenant_of_user
from tasks.states import TERMINAL_STATES, State


def tenant_required(view):
    @login_required
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        tenant = tenant_of_user(request.user)
        if tenant is None:
            if request.user.is_staff:
                return redirect("admin:index")
            return render(request, "portal/no_tenant.html", status=403)
        return view(request, tenant, *args, **kwargs)

    wrapper.__name__ = view.__name__
    return wrapper


@tenant_required
def task_list(request: HttpRequest, tenant) -> HttpResponse:
    state = request.GET.get("state") or None
    try:
        rows, cursor = selectors.task_list(tenant=tenant, state=state, limit=50, cursor=request.GET.get("cursor") or None)
    except SluiceError as error:
        messages.error(request, error.detail)
        rows, cursor = [], None
    context = {"tasks": rows, "next_cursor": cursor, "state": state, "tenant": tenant, "states": State.values,
               "cursor_shown": bool(request.GET.get("cursor"))}
    return render(request, "portal/task_list.html", context)


@tenant_required
def task_states(request: HttpRequest, tenant) -> HttpResponse:
    """Live refresh for the list page: the states of the tasks shown."""
    ids = [i for i in request.GET.get("ids", "").split(",") if i][:100]
    data = {}
    for task_id in ids:
        try:
            task = selectors.task_get(tenant=tenant, task_id=task_id)
        except SluiceError:
            continue
        data[task_id] = _row(task, request)
    # Tasks submitted since the list was drawn (from this page or any other client) appear too.
    newer = []
    since = request.GET.get("since", "")
    if since:
        try:
            rows, _ = selectors.task_list(tenant=tenant, state=request.GET.get("state") or None, limit=20)
        except SluiceError:
            rows = []
        newer = [{"id": str(t.pk), **_row(t, request)} for t in rows if t.created_at.isoformat() > since and str(t.pk) not in ids]
    return JsonResponse({"tasks": data, "new": newer})


def _row(task, request) -> dict:
    from tasks.templatetags.sluice import when

    return {"state": task.state, "terminal": task.state in TERMINAL_STATES,
            "waiting_reason": wording.waiting_words(waiting_reason(task)), "outcome": _outcome(task, request.user),
            "name": task.file.label or "", "kind": task.kind, "target_format": task.target_format,
            "created": str(when(task.created_at)), "created_at": task.created_at.isoformat(),
            "url": f"/tasks/{task.pk}/"}


def _outcome(task, user) -> str:
    """How the task ended, as its owner reads it ("" while it runs)."""
    if task.state == State.CANCELLED or task.state == State.CANCEL_REQUESTED:
        by = task.events.filter(to_state__in=[State.CANCEL_REQUESTED, State.CANCELLED]).order_by("at").values_list("actor", flat=True).first()
        if by == f"user {user.username}":
            return "cancelled by you" if task.state == State.CANCELLED else "cancelling, as you asked"
        if by and (by.startswith("user ") or by.startswith("api tenant")):
            return "cancelled by your organisation"
        return "cancelled by an operator" if by else "cancelled"
    if task.state in (State.FAILED, State.EXPIRED):
        return wording.error_words(task.error_code, findings=task.file.precheck_findings)
    return ""


@tenant_required
def upload(request: HttpRequest, tenant) -> HttpResponse:
    form = SubmitForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        upload = form.cleaned_data["file"]
        try:
            version = file_create(tenant=tenant, chunks=upload.chunks(64 * 1024), label=upload_label(upload))
            submitted = task_submit(
                tenant=tenant,
                request=SubmitRequest(
                    file_id=str(version.pk), kind=form.cleaned_data["kind"],
                    target_format=form.cleaned_data["target_format"], priority=form.cleaned_data["priority"],
                ),
                idempotency_key=request.POST.get("idempotency_key") or None,
                actor=f"user {request.user.username}",
            )
        except SluiceError as error:
            field = error.extra.get("field")
            form.add_error(field if field in form.fields else "file", error.detail)
        else:
            if request.headers.get("X-Requested-With") == "XMLHttpRequest":
                return JsonResponse({"id": str(submitted.task.pk), "url": f"/tasks/{submitted.task.pk}"}, status=202)
            messages.success(request, "Accepted. It runs in the background; this page follows it.")
            return redirect("portal:task_detail", task_id=submitted.task.pk)
    if request.method == "POST" and request.headers.get("X-Requested-With") == "XMLHttpRequest":
        return JsonResponse({"errors": {k: [str(e) for e in v] for k, v in form.errors.items()}}, status=400)
    return render(request, "portal/upload.html", {"form": form, "tenant": tenant}, status=400 if form.errors else 200)


@tenant_required
def task_detail(request: HttpRequest, tenant, task_id: str) -> HttpResponse:
    try:
        task = selectors.task_get(tenant=tenant, task_id=task_id)
    except SluiceError:
        return render(request, "portal/not_found.html", status=404)
    context = {
        "task": task, "events": selectors.task_events(task=task), "waiting_reason": waiting_reason(task),
        "waiting_words": wording.waiting_words(waiting_reason(task)), "outcome": _outcome(task, request.user),
        "terminal": task.state in TERMINAL_STATES, "findings": task.file.precheck_findings or {}, "tenant": tenant,
        "download_name": result_filename(task),
    }
    return render(request, "portal/task_detail.html", context)


@require_POST
@tenant_required
def task_cancel_view(request: HttpRequest, tenant, task_id: str) -> HttpResponse:
    try:
        task = selectors.task_get(tenant=tenant, task_id=task_id)
        outcome = task_cancel(task_id=task.pk, actor=f"user {request.user.username}")
    except SluiceError as error:
        messages.error(request, error.detail)
    else:
        messages.success(request, f"Cancel: the task is now {outcome.state}.")
    return redirect("portal:task_detail", task_id=task_id)


@tenant_required
def task_download(request: HttpRequest, tenant, task_id: str) -> HttpResponse:
    try:
        return result_response(selectors.task_get(tenant=tenant, task_id=task_id))
    except SluiceError as error:
        messages.error(request, error.detail)
        return redirect("portal:task_detail", task_id=task_id)
