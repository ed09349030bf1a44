"""The console's own pages (beyond model lists): dashboard, bulk operations, billing
reconciliation, failure triage, POC runs, the fake vendor's faults, and single-object actions.

Every page needs a staff login; every action needs its permission and is refused (403) if posted
without it, whatever the page showed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db.models import CharField, Count, Max, Min
from django.db.models.functions import Cast
from django.http import FileResponse, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from console import bulk
from console.dashboard import dashboard_context
from console.inputs import int_param, uuid_or_none
from console.models import BulkOperation, PocRun
from tasks import safejson
from tasks.models import DuplicateIncident, LedgerEntry, Quarantine, Task, VendorChannel, VendorJob
from tasks.services.audit import audit
from tasks.services.operations import ACTION_PARAMS, CONFIRMATIONS, TASK_ACTIONS
from tasks.states import State


def page(site, permission: str | None = None) -> Callable:
    def decorate(view: Callable) -> Callable:
        @wraps(view)
        def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if permission and not request.user.has_perm(permission):
                    raise PermissionDenied(f"your role may not do this ({permission})")
                return view(request, *args, **kwargs)
            except PermissionDenied as denied:
                if request.method == "POST":
                    # An action refused for lack of permission is recorded like any other attempt.
                    audit(actor=request.user.get_username(), action=f"denied_{view.__name__}"[:64], target_type="console",
                          target_id=request.path[:100], skipped=1, detail={"reason": str(denied), "outcome": "denied"})
                raise

        return site.admin_view(checked)

    return decorate


def refused(request: HttpRequest, action: str, message: str, *, target_type: str = "", target_id: str = "",
            level: int = messages.ERROR) -> None:
    """An operator's action that did not happen: said on the page and recorded in the audit trail."""
    messages.add_message(request, level, message)
    audit(actor=request.user.get_username(), action=action, target_type=target_type, target_id=str(target_id),
          skipped=1, detail={"reason": message, "outcome": "refused"})


def _list_url(filter_params: dict[str, Any]) -> str:
    """The task list showing this selection (for "back" links)."""
    from django.http import QueryDict

    query = QueryDict(mutable=True)
    for key, value in filter_params.items():
        query.setlist(key, value if isinstance(value, list) else [value])
    return reverse("admin:tasks_task_changelist") + (f"?{query.urlencode()}" if query else "")


def fault_rule_from_form(data) -> dict[str, Any]:
    """A fault rule from the console's per-type form (the same rule the JSON box takes)."""
    from fakevendor.faults import PARAMETERS, RuleError, coerce_param

    kind = data.get("type", "")
    if kind not in PARAMETERS:
        raise RuleError("type", f"unknown fault type {kind!r}")
    params = {}
    for param in PARAMETERS[kind]:
        value = coerce_param(param, data.get(f"param_{param.name}", ""))
        if value is not None:
            params[param.name] = value
    rule: dict[str, Any] = {"endpoint": (data.get("endpoint") or "* *").strip(), "type": kind, "params": params}
    for name, cast in (("probability", float), ("times", int), ("after", int)):
        raw = (data.get(name) or "").strip()
        if raw:
            try:
                rule[name] = cast(raw)
            except ValueError:
                raise RuleError(name, f"must be a{'n integer' if cast is int else ' number'}") from None
    return rule


def render(request: HttpRequest, site, template: str, title: str, **context: Any) -> TemplateResponse:
    return TemplateResponse(request, template, {**site.each_context(request), "title": title, **context})


def build(site) -> list:
    from django.urls import path

    def dashboard(request):
        return render(request, site, "console/dashboard.html", "Dashboard", **dashboard_context(), app_list=site.get_app_list(request))

    def dashboard_fragment(request):
        return render(request, site, "console/_dashboard_body.html", "Dashboard", **dashboard_context())

    # --- bulk ------------------------------------------------------------------------------------------
    def bulk_preview(request, action):
        if action not in TASK_ACTIONS:
            raise PermissionDenied("unknown action")
        permission = TASK_ACTIONS[action][0]
        if not request.user.has_perm(permission):
            raise PermissionDenied(f"your role may not do this ({permission})")
        # The selection is exactly what this URL says (a filter, or ids): never a value kept from
        # an earlier page, so a second filter can not inherit the first one's tasks.
        filter_params = {k: (v if len(v) > 1 else v[0]) for k, v in request.GET.lists()
                         if k not in ("p", "o", *ACTION_PARAMS.values())}
        params = {ACTION_PARAMS[action]: request.GET.get(ACTION_PARAMS[action], "")[:64]} if action in ACTION_PARAMS else {}
        if not filter_params:
            messages.error(request, "Choose tasks first: filter the task list, then pick a bulk action.")
            return HttpResponseRedirect(reverse("admin:tasks_task_changelist"))
        queryset = bulk.tasks_matching(filter_params, request.user)
        summary = bulk.preview(action, queryset, params)
        if request.method == "POST":
            confirmation = summary["confirmation"]
            typed = request.POST.get("typed_count", "").strip()
            if confirmation == "type" and typed != str(summary["count"]):
                messages.error(request, f"Type {summary['count']} to confirm an operation on that many tasks.")
            elif confirmation == "check" and request.POST.get("confirm") != "yes":
                messages.error(request, "Tick the box to confirm.")
            elif summary["count"] == 0:
                messages.warning(request, "Nothing to do: every matching task would be skipped.")
            else:
                op = bulk.start(action=action, filter_params=filter_params, user=request.user, params=params)
                return HttpResponseRedirect(reverse("admin:bulk_progress", args=[op.pk]))
        return render(request, site, "console/bulk_preview.html", f"{TASK_ACTIONS[action][2]}: preview",
                      action=action, label=TASK_ACTIONS[action][2], summary=summary, filter_params=filter_params,
                      selection=bulk.describe(filter_params), back=_list_url(filter_params), params=params,
                      channels=VendorChannel.objects.filter(enabled=True).order_by("preference", "name")
                      if action == "move_channel" else [],
                      hidden=[(k, v) for k, values in filter_params.items() for v in (values if isinstance(values, list) else [values])])

    def bulk_progress(request, op_id):
        op = get_object_or_404(BulkOperation, pk=op_id)
        return render(request, site, "console/bulk_progress.html", f"Bulk operation #{op.pk}", op=op, selection=bulk.describe(op.filter),
                      can_cancel=request.user.has_perm(TASK_ACTIONS[op.action][0]))

    def bulk_status(request, op_id):
        op = get_object_or_404(BulkOperation, pk=op_id)
        return JsonResponse({"status": op.status, "total": op.total, "done": op.done, "skipped": op.skipped,
                             "progress_pct": op.progress_pct, "skipped_reasons": op.skipped_reasons})

    @require_POST
    def bulk_cancel(request, op_id):
        op = get_object_or_404(BulkOperation, pk=op_id)
        if not request.user.has_perm(TASK_ACTIONS[op.action][0]):
            raise PermissionDenied("your role may not cancel this")
        if bulk.cancel(op, request.user):
            messages.success(request, "Cancelling: the current batch finishes, no further batch starts.")
        return HttpResponseRedirect(reverse("admin:bulk_progress", args=[op.pk]))

    # --- single objects ---------------------------------------------------------------------------------
    @require_POST
    def task_action(request, task_id, action):
        if action not in TASK_ACTIONS:
            raise PermissionDenied("unknown action")
        permission, function, label = TASK_ACTIONS[action]
        if not request.user.has_perm(permission):
            raise PermissionDenied(f"your role may not do this ({permission})")
        task = get_object_or_404(Task.objects.select_related("file"), pk=uuid_or_none(task_id))
        if action in CONFIRMATIONS and request.POST.get("confirm") != "yes":
            messages.error(request, f"{label}: tick “{CONFIRMATIONS[action]}” to confirm.")
            audit(actor=request.user.get_username(), action=f"task_{action}", target_type="task", target_id=str(task.pk),
                  skipped=1, detail={"reason": "not confirmed"})
            return HttpResponseRedirect(reverse("admin:tasks_task_change", args=[task.pk]))
        params = {ACTION_PARAMS[action]: request.POST.get(ACTION_PARAMS[action], "")[:64]} if action in ACTION_PARAMS else {}
        outcome = function(task, request.user.get_username(), **params)
        audit(actor=request.user.get_username(), action=f"task_{action}", target_type="task", target_id=str(task.pk),
              done=int(outcome.done), skipped=int(not outcome.done),
              detail={**params, **({"reason": outcome.reason} if outcome.reason else {})})
        if outcome.done:
            messages.success(request, f"{label}: done.")
        else:
            messages.warning(request, f"{label}: nothing done — {outcome.reason}.")
        return HttpResponseRedirect(reverse("admin:tasks_task_change", args=[task.pk]))

    @require_POST
    def quarantine_action(request, entry_id, action):
        from tasks.services.quarantine import quarantine_purge, quarantine_release

        if not request.user.has_perm("tasks.manage_quarantine"):
            raise PermissionDenied("your role may not release or purge quarantine")
        entry = get_object_or_404(Quarantine, pk=entry_id)
        actor = request.user.get_username()
        if action == "release":
            params = None
            raw = request.POST.get("params", "").strip()
            if raw:
                try:
                    params = safejson.loads(raw)
                    assert isinstance(params, dict)
                except (ValueError, AssertionError):
                    request.session["quarantine_params_typed"] = raw[:4096]  # shown again, not lost
                    refused(request, "quarantine_release", "Override parameters must be a JSON object, e.g. {\"language\": \"de\"}.",
                            target_type="quarantine", target_id=entry.pk)
                    return HttpResponseRedirect(reverse("admin:tasks_quarantine_change", args=[entry.pk]))
            if not entry.is_open:
                refused(request, "quarantine_release", "This entry was already released or purged: nothing was done.",
                        target_type="quarantine", target_id=entry.pk, level=messages.WARNING)
                return HttpResponseRedirect(reverse("admin:tasks_quarantine_change", args=[entry.pk]))
            result = quarantine_release(entry=entry, actor=actor, recheck=request.POST.get("recheck") == "yes", params=params)
            if result.get("still_failing"):
                refused(request, "quarantine_release", "The re-check still quarantines this file: nothing was released.",
                        target_type="quarantine", target_id=entry.pk, level=messages.WARNING)
            else:
                messages.success(request, f"Released: {result['replayed']} task(s) replayed in the unknown-risk lane, {result['skipped']} skipped.")
        elif action == "purge":
            quarantine_purge(entry=entry, actor=actor)
            messages.success(request, "Purged: the content is deleted; the findings stay for the record.")
        else:
            raise PermissionDenied("unknown action")
        return HttpResponseRedirect(reverse("admin:tasks_quarantine_change", args=[entry.pk]))

    def quarantine_download(request, entry_id):
        """The admin role only: the raw bytes, never rendered, never under the original name; audited."""
        if not request.user.has_perm("tasks.open_quarantined_file"):
            raise PermissionDenied("only the admin role may open quarantined content")
        entry = get_object_or_404(Quarantine, pk=entry_id)
        from tasks.errors import StorageUnavailable
        from tasks.storage import open_stored

        try:
            content = None if entry.purged_at else open_stored(entry.file.storage_name)
        except OSError:
            content = None
        except StorageUnavailable as exc:
            messages.error(request, f"{exc.detail} Nothing was opened; try again.")
            return HttpResponseRedirect(reverse("admin:tasks_quarantine_change", args=[entry.pk]))
        if content is None:
            messages.error(request, "The content was purged.")
            return HttpResponseRedirect(reverse("admin:tasks_quarantine_change", args=[entry.pk]))
        audit(actor=request.user.get_username(), action="quarantine_open_file", target_type="quarantine",
              target_id=str(entry.pk), done=1, detail={"reason": entry.reason})
        response = FileResponse(content, content_type="application/octet-stream", as_attachment=True,
                                filename=f"quarantined-{entry.pk}.bin")
        response["X-Content-Type-Options"] = "nosniff"
        response["Content-Security-Policy"] = "sandbox; default-src 'none'"
        return response

    @require_POST
    def channel_force(request, channel_name):
        from tasks.services.operations import BREAKER_CHOICES, breaker_force

        if not request.user.has_perm("tasks.operate_channels"):
            raise PermissionDenied("your role may not force breakers")
        channel = get_object_or_404(VendorChannel, pk=channel_name)
        state = request.POST.get("state", "")
        if state not in BREAKER_CHOICES:
            refused(request, "breaker_force", f"Choose one of {', '.join(BREAKER_CHOICES)}.", target_type="channel",
                    target_id=channel.pk)
        elif breaker_force(channel=channel, state=state, actor=request.user.get_username()):
            messages.success(request, f"Breaker of {channel.name} is now {state}.")
        else:
            refused(request, "breaker_force", "The breaker changed meanwhile; look again and retry.", target_type="channel",
                    target_id=channel.pk, level=messages.WARNING)
        return HttpResponseRedirect(reverse("admin:tasks_vendorchannel_change", args=[channel.pk]))

    # --- billing reconciliation and failure triage ----------------------------------------------------------
    def billing(request):
        from tasks.services.billing import task_of_client_ref

        since = timezone.now() - timedelta(days=int_param(request, "days", 30, low=1, high=3650))
        rows: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: defaultdict(int))
        jobs = {(j.channel_id, j.vendor_job_id): j for j in VendorJob.objects.filter(created_at__gte=since).select_related("task__tenant")}
        for job in jobs.values():
            row = rows[(job.created_at.date().isoformat(), job.task.tenant.name)]
            row["our_jobs"] += 1
        tasks_by_ref: dict[str, Task | None] = {}
        for entry in LedgerEntry.objects.filter(billed_at__gte=since).order_by("billed_at"):
            job = jobs.get((entry.channel_id, entry.job_id))
            if entry.client_ref not in tasks_by_ref:
                tasks_by_ref[entry.client_ref] = task_of_client_ref(entry.client_ref) if entry.client_ref else None
            task = job.task if job else tasks_by_ref[entry.client_ref]
            tenant = task.tenant.name if task else "(no task)"
            row = rows[(entry.billed_at.date().isoformat(), tenant)]
            row["billed"] += 1
            row["billed_cents"] += entry.amount_cents
            if job is None and task is None:
                row["orphans"] += 1
                row["orphan_cents"] += entry.amount_cents
            elif job is not None and job.status == "lost":
                row["billed_lost"] += 1
                row["billed_lost_cents"] += entry.amount_cents
            elif job is not None and job.status in ("failed", "canceled"):
                row["billed_failed"] += 1
                row["billed_failed_cents"] += entry.amount_cents
                row.setdefault("billed_failed_ids", []).append(str(job.task_id))
        for incident in DuplicateIncident.objects.filter(created_at__gte=since).select_related("task__tenant"):
            row = rows[(incident.created_at.date().isoformat(), incident.task.tenant.name)]
            row["billed_twice"] += len(incident.duplicate_job_ids)
            row["billed_twice_cents"] += incident.duplicate_amount_cents
        table = [{"day": day, "tenant": tenant, **values} for (day, tenant), values in sorted(rows.items(), reverse=True)]
        totals: dict[str, int] = defaultdict(int)
        for row in table:
            for key, value in row.items():
                if isinstance(value, int):
                    totals[key] += value
        from tasks.models import ChannelHealth

        syncs = ChannelHealth.objects.select_related("channel").order_by("channel_id")
        return render(request, site, "console/billing.html", "Billing reconciliation", table=table, totals=dict(totals),
                      can_sync=request.user.has_perm("tasks.operate_channels"), syncs=syncs)

    @require_POST
    def billing_sync(request):
        from tasks.services.billing import billing_reconcile

        if not request.user.has_perm("tasks.operate_channels"):
            raise PermissionDenied("your role may not sync ledgers")
        result = billing_reconcile()
        audit(actor=request.user.get_username(), action="billing_reconcile", done=result["duplicates_reported"], detail=result)
        for item in result["incomplete"]:
            messages.warning(request, f"Ledger of {item['channel']} {item['summary']}.")
        done = "Ledgers synced" if not result["incomplete"] else "Ledgers partly synced"
        messages.success(request, f"{done}: {result['ledger_entries']} new entries, "
                                  f"{result['duplicates_reported']} task(s) found billed more than once.")
        return HttpResponseRedirect(reverse("admin:billing"))

    def triage(request):
        # PostgreSQL has no max(uuid): a sample id is picked from the text form (both backends).
        groups = (
            Task.objects.filter(state=State.FAILED).order_by()
            .values("error_code", "channel_id", "kind")
            .annotate(count=Count("id"), first=Min("finished_at"), last=Max("finished_at"), sample=Max(Cast("id", CharField())))
            .order_by("-count")[:100]
        )
        return render(request, site, "console/triage.html", "Failure triage", groups=groups,
                      can_act=request.user.has_perm("tasks.operate_tasks"))

    # --- QA: POC runs and the fake vendor ------------------------------------------------------------------
    def poc_list(request):
        from tasks.poc.catalog import SCENARIOS

        if request.method == "POST":
            if not request.user.has_perm("tasks.run_qa"):
                raise PermissionDenied("only the QA and admin roles may start runs")
            names = {s.name for s in SCENARIOS} | {"all"}
            scenario = request.POST.get("scenario", "")
            try:
                seed = int(request.POST.get("seed") or 7)
                tasks = int(request.POST["tasks"]) if request.POST.get("tasks") else None
                scale = float(request.POST["time_scale"]) if request.POST.get("time_scale") else None
                if scenario not in names or (tasks is not None and tasks <= 0) or (scale is not None and not 0 < scale <= 10):
                    raise ValueError
            except ValueError:
                refused(request, "poc_run", "Choose a scenario; tasks must be positive; the time scale must be in (0, 10].")
                return HttpResponseRedirect(reverse("admin:poc_list"))
            live = request.POST.get("live") == "yes"
            not_live = [s.name for s in SCENARIOS if not s.live and scenario in (s.name, "all")]
            if live and scenario != "all" and not_live:
                refused(request, "poc_run", f"{scenario} controls processes (workers, broker) and cannot run against the "
                        "live system; run it without “live”.")
            else:
                run = PocRun.objects.create(scenario=scenario, seed=seed, tasks=tasks, time_scale=scale, live=live,
                                            started_by=request.user.get_username())
                audit(actor=request.user.get_username(), action="poc_run", target_type="poc", target_id=str(run.pk),
                      detail={"scenario": scenario, "seed": seed, "tasks": tasks, "time_scale": scale, "live": live})
                from tasks.queueing import send

                send("console.poc_jobs.run_poc", run.pk, name=f"poc {run.pk}")
                return HttpResponseRedirect(reverse("admin:poc_detail", args=[run.pk]))
        return render(request, site, "console/poc_list.html", "POC scenarios", scenarios=SCENARIOS,
                      runs=PocRun.objects.all()[:50], can_run=request.user.has_perm("tasks.run_qa"))

    def poc_detail(request, run_id):
        run = get_object_or_404(PocRun, pk=run_id)
        if request.GET.get("format") == "json":
            response = JsonResponse(run.report or {}, json_dumps_params={"indent": 2})
            response["Content-Disposition"] = f'attachment; filename="poc-{run.pk}-{run.scenario}.json"'
            return response
        reports = run.report if isinstance(run.report, list) else ([run.report] if run.report else [])
        return render(request, site, "console/poc_detail.html", f"POC run #{run.pk}: {run.scenario}", run=run, reports=reports)

    JOURNAL_FILTERS = ("method", "path", "endpoint", "rule", "status", "outcome", "channel", "client_ref", "job_id",
                       "since")

    def fakevendor(request):
        from fakevendor.control import ControlError, ControlUnreachable, VendorControl
        from fakevendor.faults import FAMILY, PARAMETERS, RuleError

        control = VendorControl(settings.FAKEVENDOR_URL, settings.FAKEVENDOR_ADMIN_TOKEN, timeout=5)
        can_edit = request.user.has_perm("tasks.run_qa")
        if request.method == "POST":
            if not can_edit:
                raise PermissionDenied("only the QA and admin roles may change faults")
            op = request.POST.get("op")
            try:
                if op == "add":
                    rule = safejson.loads(request.POST.get("rule") or "{}")
                    created = control.add_rule(rule)
                    messages.success(request, f"Rule {created['id']} added.")
                elif op == "add_form":
                    rule = fault_rule_from_form(request.POST)
                    created = control.add_rule(rule)
                    messages.success(request, f"Rule {created['id']} added: {json.dumps(rule)}")
                elif op == "delete":
                    control.delete_rule(request.POST["rule_id"])
                    messages.success(request, "Rule removed.")
                elif op == "clear":
                    control.clear_rules()
                    messages.success(request, "Every rule removed.")
                elif op == "seed":
                    control.set_seed(int(request.POST.get("seed", "0")))
                    messages.success(request, "Seed set.")
                audit(actor=request.user.get_username(), action=f"fakevendor_{op}", target_type="fakevendor", done=1)
            except ValueError as exc:
                refused(request, f"fakevendor_{op}", f"Not valid JSON or number: {exc}", target_type="fakevendor")
                request.session["fault_rule_typed"] = (request.POST.get("rule") or "")[:20_000]  # not lost
            except RuleError as exc:
                refused(request, f"fakevendor_{op}", f"Refused: {exc}", target_type="fakevendor")
            except ControlUnreachable as exc:
                refused(request, f"fakevendor_{op}", f"The fake vendor at {settings.FAKEVENDOR_URL} did not answer: {exc}.",
                        target_type="fakevendor")
                request.session["fault_rule_typed"] = (request.POST.get("rule") or "")[:20_000]
            except ControlError as exc:
                refused(request, f"fakevendor_{op}", f"Refused: {exc} (field: {exc.field})" if exc.field else f"Refused: {exc}",
                        target_type="fakevendor")
                request.session["fault_rule_typed"] = (request.POST.get("rule") or "")[:20_000]
            return HttpResponseRedirect(reverse("admin:fakevendor"))
        reachable = control.health()
        context = {"reachable": reachable, "url": settings.FAKEVENDOR_URL, "can_edit": can_edit,
                   "fault_forms": [(kind, FAMILY[kind], params) for kind, params in PARAMETERS.items()],
                   "rule_typed": request.session.pop("fault_rule_typed", "")}
        if reachable:
            filters = {k: request.GET.get(k, "").strip()[:200] for k in JOURNAL_FILTERS}
            try:
                journal = control.journal(limit=50, detail=True, order="desc", **filters)
                counted = control.journal_count(**filters)
            except ControlError as exc:
                messages.error(request, f"Journal filter refused: {exc}" + (f" (field: {exc.field})" if exc.field else ""))
                journal, counted = [], None
            context.update(rules=control.rules(), journal=journal, journal_count=counted, journal_filters=filters,
                           scenarios=control.scenarios(), invariants=control.invariants())
        return render(request, site, "console/fakevendor.html", "Fake vendor", **context)

    return [
        path("", page(site)(dashboard), name="index"),
        path("dashboard/fragment/", page(site)(dashboard_fragment), name="dashboard_fragment"),
        path("bulk/<str:action>/preview/", page(site)(bulk_preview), name="bulk_preview"),
        path("bulk/<int:op_id>/", page(site)(bulk_progress), name="bulk_progress"),
        path("bulk/<int:op_id>/status.json", page(site)(bulk_status), name="bulk_status"),
        path("bulk/<int:op_id>/cancel/", page(site)(bulk_cancel), name="bulk_cancel"),
        path("task/<str:task_id>/<str:action>/", page(site)(task_action), name="task_action"),
        path("quarantine/<int:entry_id>/download/", page(site)(quarantine_download), name="quarantine_download"),
        path("quarantine/<int:entry_id>/<str:action>/", page(site)(quarantine_action), name="quarantine_action"),
        path("channel/<str:channel_name>/force/", page(site)(channel_force), name="channel_force"),
        path("billing/", page(site)(billing), name="billing"),
        path("billing/sync/", page(site)(billing_sync), name="billing_sync"),
        path("triage/", page(site)(triage), name="triage"),
        path("poc/", page(site)(poc_list), name="poc_list"),
        path("poc/<int:run_id>/", page(site)(poc_detail), name="poc_detail"),
        path("fakevendor/", page(site)(fakevendor), name="fakevendor"),
    ]
