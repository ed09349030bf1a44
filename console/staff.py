from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from console.roles import ROLES, roles_ensure
from tasks.models import AuditEntry


@transaction.atomic
def staff_ensure(*, username: str, role: str, actor: str, password: str | None = None) -> tuple[object, str]:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if not Group.objects.filter(name=role).exists():
        roles_ensure()
    user, created = get_user_model().objects.get_or_create(username=username)
    password = password or secrets.token_urlsafe(12)
    user.set_password(password)
    user.is_staff = True
    user.is_superuser = False
    user.save()
    user.groups.set([Group.objects.get(name=role)])
    AuditEntry.objects.create(actor=actor, action="staff_role_set", target_type="user", target_id=username,
                              done=1, detail={"role": role, "created": created})
    return user, password
