"""Model admins of the operator console. Read-only where state is concerned: every action goes
through the domain services (tasks.services.operations), is permission-checked and audited."""

from __future__ import annotations

import uuid

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.db.models import Q
from django.http import HttpRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from console.admin_site import site
from console.auditing import Audited
from console.inputs import ERROR_CODE_NONE
from console.models import BulkOperation, PocRun
from console.roles import role_of
from tasks import selectors, wording
from tasks.models import (
    AuditEntry,
    DeadLetter,
    DuplicateIncident,
    Lane,
    LedgerEntry,
    Notification,
    Quarantine,
    QuotaOverride,
    Task,
    Tenant,
    TenantQuota,
    VendorCall,
    VendorChannel,
    VendorJob,
)
from tasks.scheduling.waiting import waiting_reason, waiting_reasons
from tasks.services.operations import TASK_ACTIONS
from tasks.states import WAITING_REASONS, State

CONFIGURE = "tasks.configure"


class Checked(admin.ModelAdmin):
    """List filters that cannot be applied are a 400 page naming them (Django's own answer is a
    redirect to a "database error" page)."""

    def get_changelist_instance(self, request):
        from django.contrib.admin.options import IncorrectLookupParameters

        from console.inputs import BadInput

        try:
            return super().get_changelist_instance(request)
        except IncorrectLookupParameters as error:
            raise BadInput(f"These filters cannot be applied ({error}); open the list again and pick filters from it.") from None


class ReadOnly(Checked):
    """Visible to every role; nothing is edited through a form."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class Configurable(Audited, Checked):
    """Editable by the admin role (tasks.configure), visible to every role."""

    def has_add_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_delete_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)


# --- tasks ------------------------------------------------------------------------------------------
class ErrorCodeFilter(admin.SimpleListFilter):
    title = "error code"
    parameter_name = "error_code"

    def lookups(self, request, model_admin):
        codes = Task.objects.exclude(error_code="").order_by().values_list("error_code", flat=True).distinct()[:50]
        return [(c, c) for c in codes] + [(ERROR_CODE_NONE, "none")]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(error_code="" if self.value() == ERROR_CODE_NONE else self.value())


class WaitingFilter(admin.SimpleListFilter):
    """Tasks by why they wait: stored for RETRY_WAIT and RECONCILING, derived for queued work (the
    same reasons the task page and the API show)."""

    title = "waiting because"
    parameter_name = "waiting"
    DERIVED_SCAN = 5000  # queued tasks examined for a derived reason

    def lookups(self, request, model_admin):
        return [(code, code) for code in WAITING_REASONS]

    def queryset(self, request, queryset):
        code = self.value()
        if not code:
            return queryset
        if code not in WAITING_REASONS:
            from console.inputs import BadInput

            raise BadInput(f"waiting={code} is not a waiting reason; pick one from the filter.")
        stored = Q(state__in=[State.RETRY_WAIT, State.RECONCILING], waiting_reason=code)
        if code == "retry_backoff":
            stored |= Q(state=State.RETRY_WAIT, waiting_reason="")
        if code == "reconciling":
            stored |= Q(state=State.RECONCILING, waiting_reason="")
        stored |= Q(state=State.RUNNING, phase=Task.Phase.FETCH, waiting_reason=code, fetch_attempts__gt=0)
        if code == "precheck":
            stored |= Q(state=State.ACCEPTED, deferred=False)
        if code == "lane_full":
            stored |= Q(state=State.ACCEPTED, deferred=True)
        queued = queryset.filter(state=State.QUEUED, dispatched_at__isnull=True).select_related("lane", "tenant")
        derived = [pk for pk, reason in waiting_reasons(queued[:self.DERIVED_SCAN]).items() if reason == code]
        return queryset.filter(stored | Q(pk__in=derived))


class IdsFilter(admin.ListFilter):
    """?ids=<uuid>,<uuid>…: exactly these tasks (links from billing, bulk selections)."""

    title = "chosen tasks"
    parameter_name = "ids"
    template = "console/filters/chosen.html"

    def __init__(self, request, params, model, model_admin):
        super().__init__(request, params, model, model_admin)
        value = params.pop(self.parameter_name, None)
        self.value = (value[-1] if isinstance(value, list) else value) or ""

    def has_output(self):
        return True  # Django applies only filters with output; the template shows a clear link when set

    def expected_parameters(self):
        return [self.parameter_name]

    def queryset(self, request, queryset):
        from console.inputs import uuid_list

        return queryset.filter(pk__in=uuid_list("ids", self.value)) if self.value else queryset

    def choices(self, changelist):
        return []


class HeldByFilter(admin.SimpleListFilter):
    """The work an outage of one channel holds: tasks of that channel waiting (queued, retrying,
    reconciling) and queued tasks that wait because every channel able to take them is open."""

    title = "held by channel"
    parameter_name = "held_by"

    def lookups(self, request, model_admin):
        return [(c, c) for c in VendorChannel.objects.order_by("preference", "name").values_list("name", flat=True)]

    def queryset(self, request, queryset):
        name = self.value()
        if not name:
            return queryset
        waiting = queryset.filter(state__in=[State.QUEUED, State.RETRY_WAIT, State.RECONCILING]).exclude(dispatched_at__isnull=False, state=State.QUEUED)
        queued = waiting.filter(state=State.QUEUED, channel__isnull=True).select_related("lane", "tenant")
        blocked = [pk for pk, reason in waiting_reasons(queued[:WaitingFilter.DERIVED_SCAN]).items() if reason == "breaker_open"]
        return waiting.filter(Q(channel_id=name) | Q(pk__in=blocked))


class CreatedRangeFilter(admin.ListFilter):
    """Time range on created_at: ?created_from=2026-11-29T10:00&created_to=…"""

    title = "created between"
    template = "console/filters/range.html"
    params = ("created_from", "created_to")

    def __init__(self, request, params, model, model_admin):
        super().__init__(request, params, model, model_admin)
        self.values = {}
        for name in self.params:
            if name in params:
                value = params.pop(name)
                self.values[name] = value[-1] if isinstance(value, list) else value

    def has_output(self):
        return True

    def expected_parameters(self):
        return list(self.params)

    def queryset(self, request, queryset):
        from console.inputs import datetime_param

        for name, lookup in (("created_from", "created_at__gte"), ("created_to", "created_at__lte")):
            value = datetime_param(name, self.values.get(name, "") or "")
            if value:
                queryset = queryset.filter(**{lookup: value})
        return queryset

    def choices(self, changelist):
        yield {"values": self.values, "query": changelist.get_query_string(remove=list(self.params))}


@admin.register(Task, site=site)
class TaskAdmin(ReadOnly):
    list_display = ("short_id", "file_name", "tenant", "state_badge", "waiting", "lane", "kind", "channel", "tries",
                    "error", "created")
    list_display_links = None  # the id column is the link
    list_filter = (IdsFilter, "state", WaitingFilter, HeldByFilter, "lane", "kind", "priority", ("tenant", admin.RelatedOnlyFieldListFilter),
                   ErrorCodeFilter, ("channel", admin.RelatedOnlyFieldListFilter), CreatedRangeFilter)
    ordering = ("-created_at", "-id")  # newest first
    search_fields = ("vendor_client_ref",)
    search_help_text = ("Task id, vendor job id, client ref, an Idempotency-Key (ours or the vendor's), tenant name, "
                        "file name, or text in the parameters.")
    list_select_related = ("tenant", "lane", "channel", "file")
    date_hierarchy = "created_at"
    change_list_template = "console/task_change_list.html"
    show_full_result_count = True
    actions = ["bulk_retry_now", "bulk_move_channel", "bulk_cancel", "bulk_replay"]

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Task):
        return format_html('<a href="{}"><code>{}</code></a>', reverse("admin:tasks_task_change", args=[obj.pk]), str(obj.pk)[:8])

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Task):
        return format_html('<span class="sluice-state sluice-{}">{}</span>', obj.state.lower(), obj.state)

    @admin.display(description="tries", ordering="attempts")
    def tries(self, obj: Task):
        return obj.attempts

    @admin.display(description="file")
    def file_name(self, obj: Task):
        label = obj.file.label or "—"
        return format_html('<span class="sluice-file" title="{}">{}</span>', label, label)

    @admin.display(description="waiting")
    def waiting(self, obj: Task):
        code = obj.sluice_waiting if hasattr(obj, "sluice_waiting") else waiting_reason(obj)
        if not code:
            return ""
        return format_html('<span class="sluice-waiting-code" title="{}">{}</span>', wording.waiting_words(code), code)

    @admin.display(description="error", ordering="error_code")
    def error(self, obj: Task):
        if not obj.error_code:
            return ""
        return format_html('<span title="{}">{}</span>', wording.error_words(obj.error_code), obj.error_code)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Task):
        from tasks.templatetags.sluice import when

        return when(obj.created_at)

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        # The page's reasons in one pass (what they share is read once, not once per row).
        reasons = waiting_reasons(changelist.result_list)
        for task in changelist.result_list:
            task.sluice_waiting = reasons[task.pk]
        return changelist

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        query = Q(vendor_client_ref__icontains=term) | Q(idempotency_key=term) | Q(vendor_idempotency_key=term)
        query |= Q(vendor_jobs__vendor_job_id=term) | Q(tenant__name__iexact=term) | Q(file__label__icontains=term)
        query |= Q(params__icontains=term)
        try:
            query |= Q(pk=uuid.UUID(term))
        except ValueError:
            pass
        return queryset.filter(query).distinct(), True

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("tasks.view_task")

    def get_actions(self, request):
        actions = super().get_actions(request)
        for name, (permission, _, _) in TASK_ACTIONS.items():
            if not request.user.has_perm(permission):
                actions.pop(f"bulk_{name}", None)
        actions.pop("delete_selected", None)
        return actions

    def _to_preview(self, request, queryset, action: str):
        # The preview's URL carries the selection: the filter shown (all pages) or the ids ticked.
        if request.POST.get("select_across") == "1":
            query = request.GET.urlencode()
        else:
            query = "ids=" + ",".join(str(pk) for pk in queryset.values_list("pk", flat=True))
        return HttpResponseRedirect(reverse("admin:bulk_preview", args=[action]) + "?" + query)

    @admin.action(description="Retry now… (preview first)")
    def bulk_retry_now(self, request, queryset):
        return self._to_preview(request, queryset, "retry_now")

    @admin.action(description="Move to another channel… (preview first)")
    def bulk_move_channel(self, request, queryset):
        return self._to_preview(request, queryset, "move_channel")

    @admin.action(description="Cancel… (preview first)")
    def bulk_cancel(self, request, queryset):
        return self._to_preview(request, queryset, "cancel")

    @admin.action(description="Replay… (preview first)")
    def bulk_replay(self, request, queryset):
        return self._to_preview(request, queryset, "replay")

    def change_view(self, request: HttpRequest, object_id, form_url="", extra_context=None):
        from console.inputs import uuid_or_none

        task = Task.objects.select_related("tenant", "lane", "channel", "file", "vendor_job").filter(pk=uuid_or_none(object_id)).first()
        if task is None or not self.has_view_permission(request, task):
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        jobs = list(VendorJob.objects.filter(task=task).order_by("created_at"))
        ledger = {e.job_id: e for e in LedgerEntry.objects.filter(job_id__in=[j.vendor_job_id for j in jobs])}
        from tasks.services.operations import ACTION_PARAMS, CONFIRMATIONS, WARNINGS, applicable

        actions = [
            (name, label, CONFIRMATIONS.get(name, ""), WARNINGS.get(name, "")) for name, (permission, _, label) in TASK_ACTIONS.items()
            if request.user.has_perm(permission) and applicable(name, task) and name not in ACTION_PARAMS
        ]
        if applicable("move_channel", task) and request.user.has_perm(TASK_ACTIONS["move_channel"][0]):
            context_channels = [c for c in VendorChannel.objects.filter(enabled=True).order_by("preference", "name")
                                if c.name != task.channel_id]
        else:
            context_channels = []
        context = {
            **self.admin_site.each_context(request),
            "title": f"Task {task.pk}",
            "opts": self.opts,
            "task": task,
            "events": task.events.order_by("at", "id"),
            "attempts": task.attempt_rows.order_by("generation"),
            "calls": VendorCall.objects.filter(task=task).order_by("-id")[:100],
            "jobs": [(job, ledger.get(job.vendor_job_id)) for job in jobs],
            "incidents": DuplicateIncident.objects.filter(task=task),
            "findings": task.file.precheck_findings or {},
            "waiting_reason": waiting_reason(task),
            "stages": selectors.task_stages(task=task),
            "notifications": Notification.objects.filter(task=task),
            "dead_letters": DeadLetter.objects.filter(task=task) if request.user.has_perm("tasks.view_deadletter") else [],
            "actions": actions,
            "move_to": context_channels,
            "role": role_of(request.user),
        }
        return TemplateResponse(request, "console/task_detail.html", context)


# --- quarantine, dead letters, notifications ------------------------------------------------------------
@admin.register(Quarantine, site=site)
class QuarantineAdmin(ReadOnly):
    list_display = ("id", "tenant", "reason", "detector_version", "created_at", "expires_at", "status")
    list_filter = ("reason", ("tenant", admin.RelatedOnlyFieldListFilter))
    readonly_fields = ("tenant", "reason", "detector_version", "converter_version", "findings_readable", "created_at",
                       "expires_at", "released_at", "released_by", "purged_at", "sha256")
    exclude = ("file", "release_params", "findings")  # shown readable above and in findings_readable
    change_form_template = "console/quarantine_change_form.html"

    @admin.display(description="findings")
    def findings_readable(self, obj: Quarantine):
        from tasks.templatetags.sluice import readable

        return readable({k: v for k, v in (obj.findings or {}).items() if k != "notes"})

    @admin.display(description="status")
    def status(self, obj: Quarantine):
        return "purged" if obj.purged_at else "released" if obj.released_at else "held"

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("tasks.manage_quarantine")

    def has_module_permission(self, request):
        return request.user.has_perm("tasks.manage_quarantine")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        entry = Quarantine.objects.filter(pk=object_id).first() if str(object_id).isdigit() else None
        held = Task.objects.filter(tenant_id=entry.tenant_id, file__sha256=entry.sha256).order_by("-created_at") if entry else []
        extra_context = {**(extra_context or {}),
                         "can_act": request.user.has_perm("tasks.manage_quarantine"),
                         "can_open": request.user.has_perm("tasks.open_quarantined_file"),
                         "held_tasks": list(held[:50]) if entry else [],
                         "replayable": held.filter(state=State.FAILED, error_code="quarantined").count() if entry else 0,
                         "params_typed": request.session.pop("quarantine_params_typed", "")}
        return super().change_view(request, object_id, form_url, extra_context)


@admin.register(DeadLetter, site=site)
class DeadLetterAdmin(ReadOnly):
    """References only: no content, no filenames, no download links."""

    list_display = ("task_link", "tenant", "error_class", "error_code", "attempts", "created_at", "resolution")
    list_filter = ("error_code", "resolution", ("tenant", admin.RelatedOnlyFieldListFilter))
    actions = ["replay", "discard"]

    @admin.display(description="task")
    def task_link(self, obj: DeadLetter):
        return format_html('<a href="{}"><code>{}</code></a>', reverse("admin:tasks_task_change", args=[obj.task_id]),
                           str(obj.task_id)[:8])

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("tasks.manage_quarantine")

    def has_module_permission(self, request):
        return request.user.has_perm("tasks.manage_quarantine")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        if not request.user.has_perm("tasks.manage_quarantine"):
            return {}
        return actions

    def _preview(self, request, queryset, action):
        ids = ",".join(str(t) for t in queryset.values_list("task_id", flat=True))
        return HttpResponseRedirect(reverse("admin:bulk_preview", args=[action]) + "?ids=" + ids)

    @admin.action(description="Replay… (preview first)")
    def replay(self, request, queryset):
        return self._preview(request, queryset, "replay")

    @admin.action(description="Discard… (preview first)")
    def discard(self, request, queryset):
        return self._preview(request, queryset, "discard")


@admin.register(Notification, site=site)
class NotificationAdmin(ReadOnly):
    list_display = ("event_id", "task", "event_type", "status", "attempts", "last_status_code", "last_error", "next_attempt_at")
    list_filter = ("status", "event_type")
    exclude = ("payload", "url")
    readonly_fields = ("event_id", "task", "tenant", "event_type", "status", "attempts", "max_attempts", "next_attempt_at",
                       "last_status_code", "last_error", "delivered_at", "created_at")
    actions = ["resend"]

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions if request.user.has_perm("tasks.operate_tasks") else {}

    @admin.action(description="Re-send (same event id)")
    def resend(self, request, queryset):
        from tasks.services.audit import audit
        from tasks.services.notifications import notification_resend

        done = sum(notification_resend(notification_id=n.pk) for n in queryset)
        skipped = queryset.count() - done
        audit(actor=request.user.get_username(), action="notification_resend", target_type="notification",
              done=done, skipped=skipped, detail={"ids": [n.pk for n in queryset][:100]})
        self.message_user(request, f"{done} re-sent, {skipped} were still being delivered", messages.SUCCESS)


# --- configuration ------------------------------------------------------------------------------------------
class LaneForm(forms.ModelForm):
    class Meta:
        model = Lane
        fields = "__all__"

    def clean_execution_timeout_s(self):
        from django.conf import settings

        value = self.cleaned_data.get("execution_timeout_s")
        name = self.instance.name if self.instance and self.instance.pk else self.data.get("name", "")
        bound = settings.LANE_EXECUTION_TIMEOUT_S.get(name)
        if value is not None and bound is not None and value > bound:
            raise forms.ValidationError(
                f"The {name} lane's workers stop any step after {bound:g} s, so its execution timeout can be at most that. "
                f"To allow more, set SLUICE_LANE_EXECUTION_TIMEOUT_S={name}={int(value)} and restart the workers.")
        return value


@admin.register(Lane, site=site)
class LaneAdmin(Configurable):
    form = LaneForm
    list_display = ("name", "running_state", "max_running", "max_queued", "queue_deadline_s", "execution_timeout_s",
                    "overflow_policy", "early_close_pct", "dispatch_order")
    list_editable = ()
    actions = ["pause", "resume"]

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions if request.user.has_perm("tasks.operate_channels") else {}

    @admin.display(description="state", ordering="paused")
    def running_state(self, obj: Lane):
        if obj.paused:
            return mark_safe('<strong class="sluice-warn" data-lane-state="paused">paused</strong>')
        return mark_safe('<span data-lane-state="running">running</span>')

    @admin.action(description="Pause… (asks first)")
    def pause(self, request, queryset):
        from tasks.services.operations import lane_change

        if request.POST.get("confirmed") != "yes":
            queued = Task.objects.filter(lane__in=queryset, state__in=[State.ACCEPTED, State.QUEUED]).count()
            return TemplateResponse(request, "console/confirm_action.html", {
                **self.admin_site.each_context(request), "title": f"Pause {queryset.count()} lane(s)?",
                "consequence": f"No new work starts in them until someone resumes them; {queued} task(s) waiting there "
                               "keep waiting (running work finishes). Resume undoes it.",
                "items": [lane.name for lane in queryset], "queryset": queryset, "action": "pause",
                "button": "Pause them", "back": reverse("admin:tasks_lane_changelist"),
            })
        for lane in queryset:
            lane_change(lane=lane, actor=request.user.get_username(), paused=True)
        self.message_user(request, f"{queryset.count()} lane(s) paused")

    @admin.action(description="Resume")
    def resume(self, request, queryset):
        from tasks.services.operations import lane_change

        for lane in queryset:
            lane_change(lane=lane, actor=request.user.get_username(), paused=False)
        self.message_user(request, f"{queryset.count()} lane(s) resumed")


SECRET_FIELDS = ("api_key", "webhook_secret")


class WriteOnlySecret(forms.CharField):
    """A secret that is set or replaced, never shown: empty keeps what is stored."""

    widget = forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"})

    def __init__(self, **kwargs):
        kwargs.update(required=False, strip=True)
        super().__init__(**kwargs)


class VendorChannelForm(forms.ModelForm):
    """A channel's configuration, checked against what its dialect can do. Its secrets are
    write-only: the form shows whether each is set (and, to admins, its last 4 characters)."""

    api_key = WriteOnlySecret(label="API key", help_text="Set or replace; leave empty to keep the current one.")
    webhook_secret = WriteOnlySecret(label="Webhook secret", help_text="Set or replace; leave empty to keep the current one.")

    class Meta:
        model = VendorChannel
        fields = "__all__"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from tasks.secrets import hint

        for name in SECRET_FIELDS:
            current = getattr(self.instance, name, "") if self.instance and self.instance.pk else ""
            self.fields[name].help_text = f"{hint(current)}. Set or replace; leave empty to keep it."
            # The stored value never reaches the form, not even as its initial value: the field
            # counts as changed only when a new value is typed.
            self.initial[name] = ""

    def clean_api_key(self):
        value = self.cleaned_data.get("api_key")
        if not value and not (self.instance and self.instance.pk and self.instance.api_key):
            raise forms.ValidationError("An API key is required.")
        return value or (self.instance.api_key if self.instance and self.instance.pk else "")

    def clean_dialect_settings(self):
        value = self.cleaned_data.get("dialect_settings")
        return {} if value in (None, "") else value

    def clean_webhook_secret(self):
        value = self.cleaned_data.get("webhook_secret")
        return value or (self.instance.webhook_secret if self.instance and self.instance.pk else "")

    def clean_lane_slots(self):
        from tasks.models import Lane
        from tasks.scheduling.budgets import lane_rows

        value = self.cleaned_data.get("lane_slots") or {}
        example = 'Give a JSON object of lanes and jobs at once, e.g. {"interactive+batch": 2, "heavy": 1}.'
        if not isinstance(value, dict):
            raise forms.ValidationError(example)
        known = set(Lane.objects.values_list("name", flat=True))
        for key, limit in value.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise forms.ValidationError(f"{key}: give a whole number of jobs, 1 or more. {example}")
        for key, (lanes, _) in lane_rows(value).items():
            unknown = sorted(lanes - known)
            if not lanes or unknown:
                raise forms.ValidationError(f"{key}: no lane named {', '.join(unknown) or 'there'} (lanes: {', '.join(sorted(known))}).")
        return value

    def clean_base_url(self):
        from django.conf import settings

        from tasks.outbound import OutboundRefused, outbound_pin

        url = self.cleaned_data.get("base_url")
        if self.data.get("dialect", getattr(self.instance, "dialect", "")) == "local":
            return ""  # the local engine is reached without HTTP
        if not url:
            raise forms.ValidationError("A vendor channel needs the vendor's base URL.")
        try:
            outbound_pin(url, allow_private=settings.VENDOR_ALLOW_PRIVATE, what="the base URL")
        except OutboundRefused as refused:
            raise forms.ValidationError(refused.detail) from None
        return url

    def clean(self):
        from tasks.vendors.capabilities import CapabilityError
        from tasks.vendors.dialects import DIALECTS

        data = super().clean()
        dialect = data.get("dialect")
        if dialect not in DIALECTS:
            return data
        base = DIALECTS[dialect][1]
        overrides = data.get("capability_overrides") or {}
        if not isinstance(overrides, dict):
            self.add_error("capability_overrides", 'Give a JSON object, e.g. {"reconcile_by": "none"}.')
            return data
        try:
            capabilities = base.narrowed(overrides)
        except CapabilityError as error:
            self.add_error("capability_overrides", str(error))
            return data
        if dialect == "aws_transcribe":
            self._clean_aws_settings(data)
        unsupported = sorted(set(data.get("kinds") or []) - capabilities.kinds)
        if unsupported:
            self.add_error("kinds", f"The {dialect} dialect does not do {', '.join(unsupported)}.")
        if data.get("mode") and data["mode"] not in capabilities.upload_modes:
            self.add_error("mode", f"The {dialect} dialect only takes files {' or '.join(sorted(capabilities.upload_modes))}.")
        return data


    def _clean_aws_settings(self, data):
        from django.conf import settings

        from tasks.outbound import OutboundRefused, outbound_pin
        from tasks.vendors.aws_transcribe import SettingsError, validate_settings

        values = data.get("dialect_settings") or {}
        try:
            validate_settings(values, data.get("api_key") or "")
        except SettingsError as error:
            field_name = "api_key" if str(error).startswith("api_key") else "dialect_settings"
            self.add_error(field_name, str(error))
            return
        if values.get("s3_endpoint_url"):
            try:
                outbound_pin(values["s3_endpoint_url"], allow_private=settings.VENDOR_ALLOW_PRIVATE,
                             what="the S3 endpoint")
            except OutboundRefused as refused:
                self.add_error("dialect_settings", f"s3_endpoint_url: {refused.detail}")


@admin.register(VendorChannel, site=site)
class VendorChannelAdmin(Configurable):
    list_display = ("name", "dialect", "base_url", "mode", "preference", "enabled", "max_inflight_jobs",
                    "max_concurrent_uploads", "breaker")
    change_form_template = "console/channel_change_form.html"
    form = VendorChannelForm

    @admin.display(description="breaker")
    def breaker(self, obj: VendorChannel):
        from tasks.vendors.breaker import health_for

        return health_for(obj).breaker_state

    def get_fields(self, request, obj=None):
        fields = list(super().get_fields(request, obj))
        if not self.has_change_permission(request, obj):
            # A read-only page would print stored values: secrets are left out (see secrets_state).
            fields = [f for f in fields if f not in SECRET_FIELDS] + ["secrets_state"]
        return fields

    def get_readonly_fields(self, request, obj=None):
        readonly = list(super().get_readonly_fields(request, obj))
        return readonly if self.has_change_permission(request, obj) else [*readonly, "secrets_state"]

    @admin.display(description="secrets")
    def secrets_state(self, obj: VendorChannel):
        return ", ".join(f"{name.replace('_', ' ')}: {'set' if getattr(obj, name) else 'not set'}" for name in SECRET_FIELDS)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        from tasks.models import BreakerTransition
        from tasks.services.operations import BREAKER_CHOICES
        from tasks.vendors.breaker import health_for

        channel = VendorChannel.objects.filter(pk=object_id).first()
        extra_context = {**(extra_context or {})}
        if channel:
            from tasks.vendors.capabilities import CapabilityError
            from tasks.vendors.dialects import capabilities_for

            try:
                capabilities = capabilities_for(channel).as_dict()
            except (CapabilityError, KeyError):
                capabilities = None
            extra_context.update(
                capabilities=capabilities,
                health=health_for(channel),
                transitions=list(BreakerTransition.objects.filter(channel=channel).order_by("-at")[:20]),
                held=Task.objects.filter(channel=channel, state__in=[State.QUEUED, State.RETRY_WAIT, State.RECONCILING])
                .exclude(state=State.QUEUED, dispatched_at__isnull=False).count(),
                breaker_choices=BREAKER_CHOICES,
                engine=_engine_status() if channel.dialect == "local" else None,
                can_force=request.user.has_perm("tasks.operate_channels"),
            )
        return super().change_view(request, object_id, form_url, extra_context)


def _engine_status() -> dict:
    from tasks import engine

    return {"installed": engine.installed(), "version": engine.engine_version()}


class TenantQuotaInline(admin.StackedInline):
    model = TenantQuota
    can_delete = False
    extra = 0

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_add_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)


class QuotaOverrideInline(admin.TabularInline):
    model = QuotaOverride
    extra = 0
    fields = ("field", "value", "starts_at", "ends_at", "reason")

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_add_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_delete_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)


@admin.register(Tenant, site=site)
class TenantAdmin(Configurable):
    list_display = ("name", "created_at", "result_retention_days")
    fields = ("name", "callback_url", "result_retention_days")
    inlines = [TenantQuotaInline, QuotaOverrideInline]


# --- records ----------------------------------------------------------------------------------------------
@admin.register(AuditEntry, site=site)
class AuditEntryAdmin(ReadOnly):
    list_display = ("at", "actor", "action", "target_type", "target_id", "done", "skipped")
    list_filter = ("action", "actor")
    search_fields = ("actor", "action", "target_id")
    readonly_fields = ("at", "actor", "action", "target_type", "target_id", "filter", "done", "skipped", "detail")


@admin.register(DuplicateIncident, site=site)
class DuplicateIncidentAdmin(ReadOnly):
    list_display = ("created_at", "task", "channel", "client_ref", "kept_job_id", "duplicate_job_ids", "duplicate_amount_cents")
    list_filter = ("channel",)


@admin.register(BulkOperation, site=site)
class BulkOperationAdmin(ReadOnly):
    list_display = ("id", "action", "status", "total", "done", "skipped", "created_by", "created_at")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return HttpResponseRedirect(reverse("admin:bulk_progress", args=[object_id]))


@admin.register(PocRun, site=site)
class PocRunAdmin(ReadOnly):
    list_display = ("id", "scenario", "status", "seed", "tasks", "started_by", "created_at")

    def has_module_permission(self, request):
        return request.user.has_perm("tasks.run_qa") or request.user.has_perm("console.view_pocrun")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return HttpResponseRedirect(reverse("admin:poc_detail", args=[object_id]))


class SluiceUserAdmin(Audited, Checked, UserAdmin):
    """Users and their roles (groups), superuser flags and permissions: every change audited."""

    list_display = ("username", "role", "is_active", "last_login")

    def user_change_password(self, request, id, form_url=""):
        response = super().user_change_password(request, id, form_url)
        if request.method == "POST" and response.status_code == 302:
            from tasks.services.audit import audit

            audit(actor=request.user.get_username(), action="user_password_change", target_type="user",
                  target_id=str(id), done=1, detail={"changes": {"password": {"before": "(set)", "after": "(replaced)"}}})
        return response

    @admin.display(description="role")
    def role(self, obj):
        return role_of(obj) or ("tenant user" if hasattr(obj, "membership") else "—")

    def has_module_permission(self, request):
        return request.user.has_perm(CONFIGURE)

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_change_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)

    def has_add_permission(self, request):
        return request.user.has_perm(CONFIGURE)

    def has_delete_permission(self, request, obj=None):
        return request.user.has_perm(CONFIGURE)


site.register(get_user_model(), SluiceUserAdmin)
