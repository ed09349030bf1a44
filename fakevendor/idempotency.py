"""The vendor's Idempotency-Key storage (per channel): a key is claimed while its create runs,
bound to the job it created, or released when the create did not happen."""

from __future__ import annotations

import time
from typing import Any

from fakevendor.store import Store


class Keys:
    def __init__(self, store: Store) -> None:
        self.store = store

    def lookup(self, channel: str, key: str) -> dict[str, Any] | None:
        rows = self.store.query("SELECT * FROM idempotency WHERE channel = ? AND key = ?", (channel, key))
        return dict(rows[0]) if rows else None

    def claim(self, channel: str, key: str) -> None:
        self.store.execute(
            "INSERT INTO idempotency (channel, key, fingerprint, job_id, state, created_at) VALUES (?,?,?,?,?,?)",
            (channel, key, "", "", "in_progress", time.time()),
        )

    def bind(self, channel: str, key: str, *, fingerprint: str, job_id: str) -> None:
        self.store.execute(
            "UPDATE idempotency SET fingerprint = ?, job_id = ?, state = 'done' WHERE channel = ? AND key = ?",
            (fingerprint, job_id, channel, key),
        )

    def release(self, channel: str, key: str) -> None:
        """Forget a claim whose create did not happen: the client may fix the request and retry."""
        self.store.execute("DELETE FROM idempotency WHERE channel = ? AND key = ? AND state = 'in_progress'",
                           (channel, key))
