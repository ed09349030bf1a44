"""Secrets at rest: vendor API keys, webhook secrets and any adapter credential are stored encrypted
(Fernet: AES-128-CBC with HMAC-SHA256) and are write-only everywhere they are shown.

The key comes from the environment: `SLUICE_SECRETS_KEYS`, one or more Fernet keys separated by
commas, the first encrypting and every one decrypting (rotation: put the new key first, keep the
old one after it, run `manage.py secrets_rotate`, then drop the old one). Without it the key is
derived from SECRET_KEY (HKDF), so an installation that keeps its secret key keeps its secrets;
that derived key is always tried last when decrypting.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.db import models

PREFIX = "fernet:"


class SecretUnreadable(Exception):
    """A stored secret cannot be decrypted with the configured keys (a key was dropped too soon)."""


def _fernet() -> MultiFernet:
    """The configured keys, then the one derived from SECRET_KEY: an installation that starts with
    the derived key and later sets SLUICE_SECRETS_KEYS can still read, and rotate, what it stored."""
    return _keys(settings.SECRETS_KEYS or "", settings.SECRET_KEY)


@functools.lru_cache(maxsize=4)
def _keys(configured: str, secret_key: str) -> MultiFernet:
    """Built once per setting (deriving the key cost six times the decryption, and every channel
    read decrypts its secrets): a changed setting builds its own."""
    keys = [k.strip() for k in configured.split(",") if k.strip()]
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"sluice-secrets", info=b"at-rest").derive(
        secret_key.encode())
    return MultiFernet([Fernet(k) for k in [*keys, base64.urlsafe_b64encode(derived).decode()]])


def seal(plain: str) -> str:
    return PREFIX + _fernet().encrypt(plain.encode()).decode() if plain else ""


def unseal(stored: str) -> str:
    if not stored or not stored.startswith(PREFIX):
        return stored  # empty, or written before encryption (sealed again on the next save)
    try:
        return _fernet().decrypt(stored[len(PREFIX):].encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("a stored secret cannot be decrypted with SLUICE_SECRETS_KEYS") from None


def rotated(stored: str) -> str:
    """The stored value encrypted again with the first key."""
    return seal(unseal(stored))


def hint(plain: str) -> str:
    """What may be shown of a secret, to admins only: that it is set, and its last 4 characters."""
    if not plain:
        return "not set"
    return f"set (…{plain[-4:]})" if len(plain) >= 12 else "set"


class SecretField(models.TextField):
    """A text column holding a secret encrypted; Python code sees the plain value."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return unseal(value) if isinstance(value, str) else value

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        if isinstance(value, str) and value and not value.startswith(PREFIX):
            return seal(value)
        return value
