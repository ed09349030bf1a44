"""What a vendor dialect can do, declared once per adapter, so the steps ask instead of assume.

The safety of a retry follows from these: an operation can be sent again after an ambiguous
failure only if the vendor can be asked what it holds for it (`reconcile_by`), and a duplicate can
be prevented (not merely detected) only where the vendor honours an idempotency key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

# How an ambiguous create is reconciled: by our client_ref (listed by the vendor), by a unique
# name the vendor refuses to reuse, by a natural key of ours the vendor echoes (the upload URL),
# or not at all.
RECONCILE_BY = ("client_ref", "unique_name", "natural_key", "none")
# How results come back: downloaded bytes the vendor vouches for with a digest, or rendered by the
# vendor on demand (a text field, a subtitle export) with nothing to check them against.
RESULT_STYLES = ("download", "export")


class CapabilityError(ValueError):
    """A capability override that is unknown, or claims more than the dialect can do."""


@dataclass(frozen=True)
class Capabilities:
    idempotency_key: bool
    reconcile_by: str
    cancel: bool
    callbacks: bool
    reports_input_digest: bool
    result: str
    billing_ledger: bool
    kinds: frozenset[str]
    upload_modes: frozenset[str]

    def __post_init__(self) -> None:
        if self.reconcile_by not in RECONCILE_BY:
            raise CapabilityError(f"reconcile_by must be one of {', '.join(RECONCILE_BY)}")
        if self.result not in RESULT_STYLES:
            raise CapabilityError(f"result must be one of {', '.join(RESULT_STYLES)}")

    @property
    def can_reconcile(self) -> bool:
        return self.reconcile_by != "none"

    def narrowed(self, overrides: dict[str, Any] | None) -> Capabilities:
        """These capabilities as an operator declared them for one channel: only ever weaker (a
        vendor whose list cannot be trusted is `reconcile_by: none`; one never claims more)."""
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        changes: dict[str, Any] = {}
        for name, value in overrides.items():
            if name not in known or name in ("kinds", "upload_modes", "result"):
                raise CapabilityError(f"{name} cannot be overridden (only idempotency_key, reconcile_by, cancel, "
                                      "callbacks, reports_input_digest, billing_ledger)")
            current = getattr(self, name)
            if name == "reconcile_by":
                if value not in RECONCILE_BY:
                    raise CapabilityError(f"reconcile_by must be one of {', '.join(RECONCILE_BY)}")
                if value not in (current, "none"):
                    raise CapabilityError(f"reconcile_by can only be narrowed to none (the dialect reconciles by {current})")
            elif not isinstance(value, bool) or (value and not current):
                raise CapabilityError(f"{name} can only be switched off (the dialect says {current})")
            changes[name] = value
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: sorted(v) if isinstance(v := getattr(self, f.name), frozenset) else v for f in fields(self)}
