"""The append-only audit trail of operators' actions."""

from __future__ import annotations

from typing import Any

from tasks.models import AuditEntry


def audit(*, actor: str, action: str, target_type: str = "", target_id: str = "", filter: dict | None = None,
          done: int = 0, skipped: int = 0, detail: dict[str, Any] | None = None) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=actor[:150], action=action[:64], target_type=target_type[:32], target_id=str(target_id)[:100],
        filter=filter or {}, done=done, skipped=skipped, detail=detail or {},
    )
