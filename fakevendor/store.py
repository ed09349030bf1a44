"""The fake vendor's own database (SQLite, separate from Sluice's): uploads, jobs, idempotency
keys, the usage ledger and the request journal.

One connection, used from the event loop thread only; commits are batched by the server's
ticker (a few milliseconds), which is plenty for a test double and keeps serving fast.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS uploads (
    id TEXT PRIMARY KEY, channel TEXT, size INTEGER, sha256 TEXT, path TEXT,
    created_at REAL, expires_at REAL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, channel TEXT, kind TEXT, target_format TEXT, client_ref TEXT,
    idempotency_key TEXT, options TEXT, input_size INTEGER, input_sha256 TEXT, input_path TEXT,
    callback_url TEXT, created_at REAL, start_at REAL, end_at REAL, canceled_at REAL,
    fail_code TEXT, fail_retryable INTEGER, digest_mismatch INTEGER DEFAULT 0,
    input_digest_mismatch INTEGER DEFAULT 0, extra TEXT DEFAULT '', not_found_until REAL DEFAULT 0, result_sha256 TEXT, result_size INTEGER,
    result_content_type TEXT, fetched_at REAL, units REAL, unit TEXT, amount_cents INTEGER,
    callback_state TEXT DEFAULT '', callback_attempts INTEGER DEFAULT 0, callback_next_at REAL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_client_ref ON jobs (channel, client_ref, created_at);
CREATE TABLE IF NOT EXISTS idempotency (
    channel TEXT, key TEXT, fingerprint TEXT, job_id TEXT, state TEXT, created_at REAL,
    PRIMARY KEY (channel, key)
);
CREATE TABLE IF NOT EXISTS ledger (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, entry_id TEXT UNIQUE, channel TEXT, job_id TEXT,
    client_ref TEXT, idempotency_key TEXT, units REAL, unit TEXT, amount_cents INTEGER, created_at REAL,
    input_sha256 TEXT DEFAULT ''
);
CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, method TEXT, path TEXT, channel TEXT,
    endpoint TEXT, rule_id TEXT, draw REAL, bytes_in INTEGER, status INTEGER, outcome TEXT,
    client_ref TEXT, idempotency_key TEXT, job_id TEXT, retry_after TEXT, duration_ms INTEGER,
    protocol TEXT, input_sha256 TEXT, request TEXT, response TEXT
);
CREATE INDEX IF NOT EXISTS journal_at ON journal (at);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
"""

JOB_COLUMNS = (
    "id", "channel", "kind", "target_format", "client_ref", "idempotency_key", "options", "input_size",
    "input_sha256", "input_path", "callback_url", "created_at", "start_at", "end_at", "canceled_at",
    "fail_code", "fail_retryable", "digest_mismatch", "input_digest_mismatch", "extra", "not_found_until", "result_sha256", "result_size",
    "result_content_type", "fetched_at", "units", "unit", "amount_cents", "callback_state",
    "callback_attempts", "callback_next_at",
)


class Store:
    def __init__(self, data_dir: str | Path) -> None:
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "uploads").mkdir(exist_ok=True)
        (self.dir / "results").mkdir(exist_ok=True)
        self.db = sqlite3.connect(self.dir / "fakevendor.sqlite3", isolation_level="DEFERRED", check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.executescript(SCHEMA)
        columns = {row["name"] for row in self.db.execute("PRAGMA table_info(journal)")}
        if "protocol" not in columns:  # a data dir from before HTTP/2
            self.db.execute("ALTER TABLE journal ADD COLUMN protocol TEXT")
        for column in ("input_sha256", "request", "response"):
            if column not in columns:  # a data dir from before the column
                self.db.execute(f"ALTER TABLE journal ADD COLUMN {column} TEXT")
        job_columns = {row["name"] for row in self.db.execute("PRAGMA table_info(jobs)")}
        if "input_digest_mismatch" not in job_columns:
            self.db.execute("ALTER TABLE jobs ADD COLUMN input_digest_mismatch INTEGER DEFAULT 0")
        if "extra" not in job_columns:
            self.db.execute("ALTER TABLE jobs ADD COLUMN extra TEXT DEFAULT ''")
        if "input_sha256" not in {row["name"] for row in self.db.execute("PRAGMA table_info(ledger)")}:
            self.db.execute("ALTER TABLE ledger ADD COLUMN input_sha256 TEXT DEFAULT ''")
        self.db.commit()
        self._dirty = False

    # --- transactions --------------------------------------------------------------------
    def execute(self, sql: str, params: tuple | dict = ()) -> sqlite3.Cursor:
        self._dirty = True
        return self.db.execute(sql, params)

    def query(self, sql: str, params: tuple | dict = ()) -> list[sqlite3.Row]:
        return self.db.execute(sql, params).fetchall()

    def flush(self) -> None:
        if self._dirty:
            self.db.commit()
            self._dirty = False

    def forget(self) -> dict[str, int]:
        """Amnesia, as after a restart of a vendor that kept its state in memory: every upload, job
        and idempotency key is gone; the ledger (what was billed) and the journal stay."""
        counts = {}
        for table in ("uploads", "jobs", "idempotency"):
            counts[table] = self.query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
            self.execute(f"DELETE FROM {table}")
        for folder in ("uploads", "results"):
            for item in (self.dir / folder).iterdir():
                item.unlink(missing_ok=True)
        self.flush()
        return counts

    def ledger(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.query("SELECT * FROM ledger ORDER BY seq")]

    def reset(self, *, state: bool, journal: bool) -> None:
        if state:
            for table in ("uploads", "jobs", "idempotency", "ledger"):
                self.execute(f"DELETE FROM {table}")
            for folder in ("uploads", "results"):
                for item in (self.dir / folder).iterdir():
                    item.unlink(missing_ok=True)
        if journal:
            self.execute("DELETE FROM journal")
        self.flush()

    # --- jobs ------------------------------------------------------------------------------
    def insert_job(self, job: dict[str, Any]) -> None:
        columns = [c for c in JOB_COLUMNS if c in job]
        self.execute(
            f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})",
            tuple(job[c] for c in columns),
        )

    def job(self, channel: str, job_id: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM jobs WHERE channel = ? AND id = ?", (channel, job_id))
        return dict(rows[0]) if rows else None

    def update_job(self, job_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*fields.values(), job_id))

    def jobs_by_client_ref(self, channel: str, client_ref: str, status: str | None, now: float) -> list[dict]:
        rows = self.query(
            "SELECT * FROM jobs WHERE channel = ? AND client_ref = ? ORDER BY created_at DESC, id DESC",
            (channel, client_ref),
        )
        jobs = [dict(r) for r in rows]
        if status:
            from fakevendor.jobs import job_status

            jobs = [j for j in jobs if job_status(j, now) == status]
        return jobs

    def add_ledger_entry(self, entry: dict[str, Any]) -> None:
        self.execute(
            "INSERT INTO ledger (entry_id, channel, job_id, client_ref, idempotency_key, units, unit,"
            " amount_cents, created_at, input_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                entry["entry_id"], entry["channel"], entry["job_id"], entry["client_ref"],
                entry["idempotency_key"], entry["units"], entry["unit"], entry["amount_cents"], entry["created_at"],
                entry.get("input_sha256", ""),
            ),
        )

    # --- journal ---------------------------------------------------------------------------
    def journal(self, entry: dict[str, Any]) -> None:
        self.execute(
            "INSERT INTO journal (at, method, path, channel, endpoint, rule_id, draw, bytes_in, status,"
            " outcome, client_ref, idempotency_key, job_id, retry_after, duration_ms, protocol, input_sha256, request,"
            " response) VALUES (:at, :method, :path, :channel, :endpoint, :rule_id, :draw, :bytes_in, :status,"
            " :outcome, :client_ref, :idempotency_key, :job_id, :retry_after, :duration_ms, :protocol, :input_sha256,"
            " :request, :response)",
            entry,
        )

    def meta_get(self, key: str, default: Any = None) -> Any:
        rows = self.query("SELECT value FROM meta WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else default

    def meta_set(self, key: str, value: Any) -> None:
        self.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))


def now() -> float:
    return time.time()
