"""Tenants, their API tokens and their users."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from tasks.models import ApiToken, Membership, Tenant, TenantQuota

TOKEN_PREFIX = "slu_"


@dataclass(frozen=True)
class IssuedToken:
    token: str
    record: ApiToken


def tenant_ensure(*, name: str) -> Tenant:
    tenant, _ = Tenant.objects.get_or_create(name=name)
    TenantQuota.objects.get_or_create(tenant=tenant)
    return tenant


def token_issue(*, tenant: Tenant, name: str = "") -> IssuedToken:
    """A new bearer token; only its SHA-256 is stored, so it is shown exactly once."""
    prefix = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    token = f"{TOKEN_PREFIX}{prefix}_{secret}"
    record = ApiToken.objects.create(tenant=tenant, name=name, prefix=prefix, token_hash=_digest(token))
    return IssuedToken(token=token, record=record)


# A process trusts a token it has checked for this many real seconds before checking it again:
# a token revoked (ApiToken.revoked_at) stops working everywhere within that time.
TOKEN_FRESH_S = 5.0
_checked: dict[str, tuple[float, Tenant]] = {}


def token_authenticate(raw: str) -> Tenant | None:
    """The tenant of a valid, unrevoked token, or None."""
    if not raw.startswith(TOKEN_PREFIX):
        return None
    digest = _digest(raw)
    checked = _checked.get(digest)
    if checked is not None and time.monotonic() - checked[0] < TOKEN_FRESH_S:
        return checked[1]
    prefix = raw[len(TOKEN_PREFIX):].split("_", 1)[0]
    record = ApiToken.objects.select_related("tenant").filter(prefix=prefix, revoked_at__isnull=True).first()
    if record is None or not hmac.compare_digest(record.token_hash, digest):
        _checked.pop(digest, None)
        return None
    now = timezone.now()
    if record.last_used_at is None or (now - record.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=record.pk).update(last_used_at=now)
    if len(_checked) > 10_000:
        _checked.clear()
    _checked[digest] = (time.monotonic(), record.tenant)
    return record.tenant


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@transaction.atomic
def tenant_user_ensure(*, username: str, tenant: Tenant) -> tuple[object, str]:
    """Create or update a business user of `tenant`; returns the user and a new password."""
    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(username=username)
    password = secrets.token_urlsafe(12)
    user.set_password(password)
    user.is_staff = False
    user.save()
    Membership.objects.update_or_create(user=user, defaults={"tenant": tenant})
    return user, password


def tenant_of_user(user) -> Tenant | None:
    membership = getattr(user, "membership", None) if user.is_authenticated else None
    return membership.tenant if membership else None
