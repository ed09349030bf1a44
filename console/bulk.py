"""Bulk actions on every task matching a filter: preview, then throttled background batches with
progress and a cancel button, audited with the filter and the counts."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from django.contrib.admin.views.main import ChangeList
from django.db.models import Avg, Count, Q, QuerySet
from django.http import HttpRequest, QueryDict
from django.urls import reverse
from django.utils import timezone

from console.inputs import ERROR_CODE_NONE, uuid_list
from console.models import BulkOperation
from tasks.models import LedgerEntry, Quarantine, Task
from tasks.queueing import send
from tasks.services.audit import audit
from tasks.services.operations import TASK_ACTIONS
from tasks.states import TERMINAL_STATES, State

BATCH = 50
THROTTLE_S = 0.2
# Actions that make the vendor work again (their preview estimates the cost).
COSTLY = {"retry_now", "replay"}
QUARANTINED = "its file is quarantined: release it (with a replay) from its quarantine entry"


def tasks_matching(filter_params: dict[str, Any], user) -> QuerySet[Task]:
    """The tasks the console's task list shows for these query parameters (all pages)."""
    if "ids" in filter_params:
        return Task.objects.filter(pk__in=uuid_list("ids", filter_params["ids"]))
    from console.admin import TaskAdmin
    from console.admin_site import site

    request = HttpRequest()
    request.method = "GET"
    request.user = user
    query = QueryDict(mutable=True)
    for key, value in filter_params.items():
        if key not in ("p", "o", "_changelist_filters", "e"):
            query.setlist(key, value if isinstance(value, list) else [value])
    request.GET = query
    request.META["QUERY_STRING"] = query.urlencode()
    model_admin: TaskAdmin = site._registry[Task]
    changelist: ChangeList = model_admin.get_changelist_instance(request)
    return changelist.get_queryset(request)


# Filter parameters and how a person says them; anything else is named as "param=value".
_WORDS = {
    "state__exact": "in state {}", "lane__name__exact": "in lane {}", "kind__exact": "of kind {}",
    "priority__exact": "of priority {}", "error_code": "failed with {}", "channel__name__exact": "on channel {}",
    "channel__isnull": "with no channel", "waiting": "waiting because {}", "q": "matching “{}”",
    "held_by": "held by channel {}",
    "created_from": "created from {}", "created_to": "created until {}",
}


def describe(filter_params: dict[str, Any]) -> str:
    """The selection in words, as the preview states it: "FAILED tasks of tenant beta, on
    channel primary, failed with engine_error" or "3 chosen tasks"."""
    from tasks.models import Tenant
    from tasks.states import WAITING_REASONS

    if "ids" in filter_params:
        ids = filter_params["ids"]
        n = len(ids) if isinstance(ids, list) else len([i for i in str(ids).split(",") if i.strip()])
        return f"{n} chosen task{'s' if n != 1 else ''}"
    parts = []
    for key, value in sorted(filter_params.items()):
        value = ", ".join(value) if isinstance(value, list) else str(value)
        if key in ("p", "o", "e", "_changelist_filters"):
            continue
        if key in ("tenant__id__exact", "tenant__pk__exact"):
            tenant = Tenant.objects.filter(pk=value).first() if value.isdigit() or len(value) > 8 else None
            parts.append(f"of tenant {tenant.name if tenant else value}")
        elif key == "error_code" and value == ERROR_CODE_NONE:
            parts.append("failed without an error code")
        elif key == "channel__isnull":
            parts.append("with no channel" if value.lower() in ("true", "1") else "with a channel")
        elif key == "waiting":
            parts.append(f"waiting because {WAITING_REASONS.get(value, value)}")
        elif key in _WORDS:
            parts.append(_WORDS[key].format(value))
        else:
            parts.append(f"{key}={value}")
    return "tasks " + ", ".join(parts) if parts else "every task"



def skip_reasons(action: str, queryset: QuerySet[Task], params: dict | None = None) -> tuple[QuerySet[Task], Counter]:
    """Which matching tasks the action would act on, and why the others would be skipped."""
    reasons: Counter = Counter()
    params = params or {}
    if action == "move_channel":
        from tasks.models import VendorChannel
        from tasks.scheduling.channels import serves

        target = VendorChannel.objects.filter(pk=params.get("to", ""), enabled=True).first()
        if target is None:
            reasons["choose an enabled channel to move them to"] += queryset.count()
            return queryset.none(), reasons
        movable = queryset.filter(state=State.QUEUED, dispatched_at__isnull=True)
        for state, n in queryset.exclude(pk__in=movable).order_by().values_list("state").annotate(n=Count("id")):
            reasons[f"only queued tasks not yet dispatched move ({state})"] += n
        kinds = [k for k in movable.order_by().values_list("kind", flat=True).distinct() if serves(target, k)]
        for kind, n in movable.exclude(kind__in=kinds).order_by().values_list("kind").annotate(n=Count("id")):
            reasons[f"channel {target.name} does not do {kind}"] += n
        eligible = movable.filter(kind__in=kinds)
        already = eligible.filter(channel_id=target.name)
        already_n = already.count()
        if already_n:
            reasons[f"already on {target.name}"] += already_n
        return eligible.exclude(pk__in=already), reasons
    if action == "retry_now":
        eligible = queryset.filter(state__in=[State.RETRY_WAIT, State.RECONCILING])
        for state, n in queryset.exclude(pk__in=eligible).order_by().values_list("state").annotate(n=Count("id")):
            reasons[f"not waiting to retry ({state})"] += n
    elif action == "cancel":
        eligible = queryset.exclude(state__in=TERMINAL_STATES)
        for state, n in queryset.filter(state__in=TERMINAL_STATES).order_by().values_list("state").annotate(n=Count("id")):
            reasons[f"already {state}"] += n
    elif action == "replay":
        candidates = queryset.filter(state__in=[State.FAILED, State.EXPIRED], file__deleted_at__isnull=True)
        quarantined = Quarantine.objects.filter(released_at__isnull=True, purged_at__isnull=True)
        blocked = Q()
        for tenant_id, sha in quarantined.values_list("tenant_id", "sha256"):
            blocked |= Q(tenant_id=tenant_id, file__sha256=sha)
        eligible = candidates.exclude(blocked) if quarantined.exists() else candidates
        held = candidates.count() - eligible.count()
        if held:
            reasons[QUARANTINED] += held
        for state, n in queryset.exclude(state__in=[State.FAILED, State.EXPIRED]).order_by().values_list("state").annotate(n=Count("id")):
            reasons[f"it is {state}, not FAILED or EXPIRED"] += n
        purged = queryset.filter(state__in=[State.FAILED, State.EXPIRED], file__deleted_at__isnull=False).count()
        if purged:
            reasons["its file was purged"] += purged
    elif action == "discard":
        eligible = queryset.filter(dead_letters__resolved_at__isnull=True).distinct()
        missing = queryset.count() - eligible.count()
        if missing:
            reasons["no open dead letter"] += missing
    else:
        raise ValueError(f"unknown bulk action {action!r}")
    return eligible, reasons


def preview(action: str, queryset: QuerySet[Task], params: dict | None = None) -> dict[str, Any]:
    eligible, reasons = skip_reasons(action, queryset, params)
    tenants = list(eligible.order_by().values_list("tenant__name").annotate(n=Count("id")).order_by("-n")[:10])
    count = eligible.count()
    cost = None
    if action in COSTLY:
        units = sum(u or 1 for u in eligible.values_list("estimated_units", flat=True))
        per_unit = LedgerEntry.objects.filter(units__gt=0).aggregate(a=Avg("amount_cents"))["a"]
        avg_units = LedgerEntry.objects.filter(units__gt=0).aggregate(a=Avg("units"))["a"]
        cents_per_unit = (per_unit / avg_units) if per_unit and avg_units else 1.0
        cost = round(units * cents_per_unit / 100, 2)
    links = {}
    if reasons.get(QUARANTINED):
        entries = held_entries(queryset)
        links[QUARANTINED] = (reverse("admin:tasks_quarantine_change", args=[entries[0]]) if len(entries) == 1
                              else reverse("admin:tasks_quarantine_changelist") + "?status=held")
    return {"matching": queryset.count(), "count": count, "tenants": tenants, "skipped": dict(reasons),
            "skipped_rows": [(reason, n, links.get(reason)) for reason, n in reasons.items()], "estimated_cost": cost, "confirmation": confirmation_for(count)}


def held_entries(queryset: QuerySet[Task]) -> list[int]:
    """The open quarantine entries holding these tasks' files."""
    pairs = set(queryset.values_list("tenant_id", "file__sha256"))
    entries = Quarantine.objects.filter(released_at__isnull=True, purged_at__isnull=True)
    return [pk for pk, tenant_id, sha in entries.values_list("pk", "tenant_id", "sha256") if (tenant_id, sha) in pairs]


def confirmation_for(count: int) -> str:
    """The bigger the operation, the more deliberate the confirmation."""
    if count > 100:
        return "type"
    if count > 10:
        return "check"
    return "button"


def start(*, action: str, filter_params: dict[str, Any], user, params: dict | None = None) -> BulkOperation:
    queryset = tasks_matching(filter_params, user)
    eligible, reasons = skip_reasons(action, queryset, params)
    op = BulkOperation.objects.create(
        action=action, filter=filter_params, params=params or {}, total=queryset.count(),
        skipped=sum(reasons.values()), skipped_reasons=dict(reasons), status=BulkOperation.Status.RUNNING,
        created_by=user.get_username(), started_at=timezone.now(),
    )
    audit(actor=user.get_username(), action=f"bulk_{action}_started", target_type="bulk", target_id=str(op.pk),
          filter=filter_params, skipped=op.skipped, detail={"total": op.total})
    send("console.bulk.run_bulk", op.pk, name=f"bulk {op.pk}")
    return op


def run_bulk(operation_id: int) -> str:
    """Background entry (control cluster): act on the eligible tasks in throttled batches."""
    from django.contrib.auth import get_user_model

    op = BulkOperation.objects.get(pk=operation_id)
    user = get_user_model().objects.get(username=op.created_by)
    permission, function, _ = TASK_ACTIONS[op.action]
    if not user.has_perm(permission):
        BulkOperation.objects.filter(pk=op.pk).update(status=BulkOperation.Status.FAILED, error="permission denied",
                                                      finished_at=timezone.now())
        return "denied"
    eligible, _ = skip_reasons(op.action, tasks_matching(op.filter, user), op.params)
    ids = list(eligible.values_list("pk", flat=True))
    reasons = Counter(op.skipped_reasons)
    done = 0
    skipped = op.skipped
    for start_index in range(0, len(ids), BATCH):
        if BulkOperation.objects.filter(pk=op.pk, status=BulkOperation.Status.CANCELLING).exists():
            break
        for task in Task.objects.filter(pk__in=ids[start_index:start_index + BATCH]).select_related("file"):
            outcome = function(task, f"{op.created_by} (bulk #{op.pk})", **(op.params or {}))
            if outcome.done:
                done += 1
            else:
                skipped += 1
                reasons[outcome.reason or "it moved on meanwhile"] += 1
        BulkOperation.objects.filter(pk=op.pk).update(done=done, skipped=skipped, skipped_reasons=dict(reasons))
        time.sleep(THROTTLE_S)
    cancelled = BulkOperation.objects.filter(pk=op.pk, status=BulkOperation.Status.CANCELLING).exists()
    status = BulkOperation.Status.CANCELLED if cancelled else BulkOperation.Status.DONE
    BulkOperation.objects.filter(pk=op.pk).update(status=status, finished_at=timezone.now(), done=done, skipped=skipped)
    audit(actor=op.created_by, action=f"bulk_{op.action}", target_type="bulk", target_id=str(op.pk), filter=op.filter,
          done=done, skipped=skipped, detail={"status": status, "skipped_reasons": dict(reasons), "total": op.total})
    return status


def cancel(op: BulkOperation, user) -> bool:
    moved = BulkOperation.objects.filter(pk=op.pk, status=BulkOperation.Status.RUNNING).update(
        status=BulkOperation.Status.CANCELLING
    )
    if moved:
        audit(actor=user.get_username(), action="bulk_cancel", target_type="bulk", target_id=str(op.pk))
    return bool(moved)
