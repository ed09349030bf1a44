"""Console roles as Django groups: viewer ⊂ operator, viewer ⊂ qa, admin has everything."""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

ROLES = ("viewer", "operator", "qa", "admin")
OPERATOR = ("operate_tasks", "manage_quarantine", "operate_channels")
QA = ("run_qa",)
ADMIN_EXTRA = ("configure", "open_quarantined_file")
OPERATOR_ONLY_VIEWS = ("view_deadletter",)


def roles_ensure() -> None:
    everything = Permission.objects.filter(codename__startswith="view_", content_type__app_label__in=("tasks", "console", "django_q"))
    # Dead letters are the failed work of tenants waiting for a decision: operators and up only.
    view = list(everything.exclude(codename__in=OPERATOR_ONLY_VIEWS))
    operator_views = list(everything.filter(codename__in=OPERATOR_ONLY_VIEWS))
    custom = {p.codename: p for p in Permission.objects.filter(content_type__app_label="tasks", content_type__model="auditentry")}
    groups = {name: Group.objects.get_or_create(name=name)[0] for name in ROLES}
    groups["viewer"].permissions.set(view)
    groups["operator"].permissions.set(view + operator_views + [custom[c] for c in OPERATOR if c in custom])
    groups["qa"].permissions.set(view + [custom[c] for c in QA if c in custom])
    groups["admin"].permissions.set(Permission.objects.all())


def role_of(user) -> str | None:
    if user.is_superuser:
        return "admin"
    names = set(user.groups.values_list("name", flat=True))
    for role in ("admin", "operator", "qa", "viewer"):
        if role in names:
            return role
    return None
