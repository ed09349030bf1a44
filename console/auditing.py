"""Every change made through a console form is audited with who, when, and each changed field's
value before and after, inline rows (quotas, overrides) included; deletions keep what was
deleted; secrets and passwords are recorded only as "set" or "replaced", never as values."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

from django.db import models
from django.http import HttpRequest

from tasks.services.audit import audit

SECRET_NAMES = ("password", "api_key", "webhook_secret", "secret", "token")


def _secret(name: str) -> bool:
    return any(part in name for part in SECRET_NAMES)


def plain(value: Any) -> Any:
    """A JSON-safe rendering of a form value."""
    if isinstance(value, models.Model):
        return str(value)
    if isinstance(value, (models.QuerySet, list, tuple, set)):
        return sorted(str(plain(v)) for v in value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool, dict)):
        return value
    return str(value)


def form_changes(form) -> dict[str, dict[str, Any]]:
    changes: dict[str, dict[str, Any]] = {}
    for name in form.changed_data:
        if _secret(name):
            changes[name] = {"before": "(secret)", "after": "(replaced)" if form.cleaned_data.get(name) else "(cleared)"}
            continue
        field = form.fields.get(name)
        before = form.initial.get(name)
        if field is not None and hasattr(field, "queryset") and before is not None:
            # Initial values of relations are primary keys: name them as the form does.
            pks = before if isinstance(before, (list, tuple)) else [before]
            pks = [p.pk if isinstance(p, models.Model) else p for p in pks]
            named = [str(o) for o in field.queryset.model._default_manager.filter(pk__in=pks)]
            before = named if isinstance(form.initial.get(name), (list, tuple)) else (named[0] if named else None)
        changes[name] = {"before": plain(before), "after": plain(form.cleaned_data.get(name))}
    return changes


def formset_changes(formset) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    label = formset.model._meta.model_name
    for form in formset.forms:
        if not hasattr(form, "cleaned_data") or form in formset.deleted_forms or not form.has_changed():
            continue
        rows.append({"row": label, "id": str(form.instance.pk) if form.instance.pk else None,
                     "op": "change" if form.initial else "add", "changes": form_changes(form)})
    for obj in getattr(formset, "deleted_objects", []):
        rows.append({"row": label, "id": str(obj.pk), "op": "delete", "was": str(obj)})
    return rows


class Audited:
    """For a ModelAdmin: saves and deletions are audited as `<model>_add|change|delete`."""

    def save_related(self, request: HttpRequest, form, formsets, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        obj = form.instance
        detail: dict[str, Any] = {"changes": form_changes(form)}
        inline_rows = [row for formset in formsets for row in formset_changes(formset)]
        if inline_rows:
            detail["rows"] = inline_rows
        audit(actor=request.user.get_username(), action=f"{obj._meta.model_name}_{'change' if change else 'add'}",
              target_type=obj._meta.model_name, target_id=str(obj.pk), done=1, detail=detail)

    def delete_model(self, request: HttpRequest, obj) -> None:
        name, pk, was = obj._meta.model_name, str(obj.pk), str(obj)
        super().delete_model(request, obj)
        audit(actor=request.user.get_username(), action=f"{name}_delete", target_type=name, target_id=pk,
              done=1, detail={"was": was})

    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        rows = [(str(o.pk), str(o)) for o in queryset]
        name = queryset.model._meta.model_name
        super().delete_queryset(request, queryset)
        for pk, was in rows:
            audit(actor=request.user.get_username(), action=f"{name}_delete", target_type=name, target_id=pk,
                  done=1, detail={"was": was})
