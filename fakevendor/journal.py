"""The request journal: what every vendor request and its answer were, kept so QA can ask.

Each entry keeps the request's and the answer's headers and bodies, bounded (`KEPT_BYTES` of
text each), with secrets redacted (credentials, signatures, tokens) and file bytes replaced by
their digest and size: the journal never holds a file's content or a key. Entries are found by
method, path (a glob), endpoint, rule (also inside a stack, "a+b"), status (exact or a class such
as "5xx"), outcome, channel, client_ref, job_id and time, and counted the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from fakevendor import jobs as J
from fakevendor.answers import parse_time
from fakevendor.store import Store

KEPT_BYTES = 4096
HASHED_FILE_BYTES = 8 * 1024 * 1024  # answers from files larger than this are described by size only
REDACTED = "[redacted]"
SECRET_HEADERS = {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key",
                  "x-vendor-signature"}
SECRET_WORDS = re.compile(r"(secret|token|password|passwd|api[_-]?key|authorization|auth_header_value|signature)", re.I)
# Bodies kept as (redacted) text; anything else (files, results, text/* answers) is a digest.
TEXT_TYPES = ("application/json", "application/problem+json", "application/x-www-form-urlencoded")
# JSON fields that carry content (a transcript's text, its words): kept as a digest.
CONTENT_WORDS = {"text", "transcript", "transcripts", "words", "utterances", "paragraphs", "sentences", "results"}


def redact_headers(headers: Any) -> dict[str, str]:
    items = headers.items() if isinstance(headers, dict) else headers
    kept = {}
    for name, value in items:
        lower = name.lower()
        secret = lower in SECRET_HEADERS or (SECRET_WORDS.search(lower) and lower != "idempotency-key")
        kept[lower] = REDACTED if secret else value
    return kept


def _digest_of(value: Any) -> str:
    return "[content sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16] + "]"


def _redact_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and SECRET_WORDS.search(k)
                else _digest_of(v) if isinstance(k, str) and k in CONTENT_WORDS and v not in (None, "", [])
                else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    return value


def body_summary(body: bytes | Path | None, content_type: str, *, sha256: str | None = None,
                 size: int | None = None) -> dict[str, Any] | None:
    """A body as the journal keeps it: bounded text for JSON and text, a digest for file bytes."""
    if isinstance(body, Path):
        try:
            size = body.stat().st_size
        except OSError:
            return None
        if sha256 is None and size <= HASHED_FILE_BYTES:
            sha256 = hashlib.sha256(body.read_bytes()).hexdigest()
        return {"size": size, "sha256": sha256, "file": True}
    if body is None:
        if size:
            return {"size": size, "sha256": sha256, "file": True}
        return None
    entry: dict[str, Any] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    if not body:
        return entry
    if not any(content_type.startswith(t) for t in TEXT_TYPES):
        entry["file"] = True
        return entry
    text = body.decode("utf-8", "replace")
    if "json" in content_type:
        try:
            text = json.dumps(_redact_json(json.loads(text)))
        except ValueError:
            # Not JSON after all (a malformed answer): only its start, with nothing secret-looking.
            text = SECRET_VALUE.sub(lambda m: m.group(1) + REDACTED, text[:256])
    else:
        text = redact_query(text)
    entry["text"] = text[:KEPT_BYTES]
    if len(text) > KEPT_BYTES:
        entry["truncated"] = True
    return entry


SECRET_VALUE = re.compile(r"((?:secret|token|password|api[_-]?key|authorization|signature)[\"']?\s*[:=]\s*[\"']?)[^\"'&,\s}]+",
                          re.I)


def redact_query(query: str) -> str:
    """A query string (or form body) with every secret-named parameter's value redacted."""
    from urllib.parse import parse_qsl, urlencode

    pairs = parse_qsl(query, keep_blank_values=True)
    return urlencode([(k, REDACTED if SECRET_WORDS.search(k) else v) for k, v in pairs], safe="[]")


def redact_target(target: str) -> str:
    path, _, query = target.partition("?")
    return f"{path}?{redact_query(query)}" if query else path


class Recorded:
    """A transport that remembers the answer sent through it (for the journal); everything else
    passes to the real one."""

    def __init__(self, conn: Any, request: Any) -> None:
        self._conn = conn
        self._request = request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def _keep(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, **extra: Any) -> None:
        if self._request.response is None:
            content_type = dict((k.lower(), v) for k, v in headers).get("content-type", "")
            sha = dict((k.lower(), v) for k, v in headers).get("x-content-sha256")
            self._request.response = {"status": status, "headers": redact_headers(headers),
                                      "body": body_summary(body, content_type, sha256=sha), **extra}

    async def respond(self, status, headers, body=b"", **options):
        self._keep(status, headers, body)
        await self._conn.respond(status, headers, body, **options)

    async def respond_truncated(self, status, headers, body, *, limit):
        self._keep(status, headers, body, cut_after_bytes=limit)
        await self._conn.respond_truncated(status, headers, body, limit=limit)

    async def respond_malformed_chunk(self, status, headers, garbage):
        self._keep(status, headers, garbage, malformed_chunk=True)
        await self._conn.respond_malformed_chunk(status, headers, garbage)

    async def respond_sliced(self, status, headers, body, **options):
        self._keep(status, headers, body)
        await self._conn.respond_sliced(status, headers, body, **options)


# --- queries ------------------------------------------------------------------------------------
class FilterError(ValueError):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


def _when(value: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        parsed = parse_time(value)
        if parsed is None:
            raise FilterError(name, f"{name} must be epoch seconds or an RFC 3339 time") from None
        return parsed


def where(query: dict[str, str]) -> tuple[str, list[Any]]:
    """The SQL condition for a journal query's filters (FilterError names a bad one)."""
    sql, params = ["1 = 1"], []
    for name in ("method", "endpoint", "channel", "client_ref", "job_id", "outcome", "protocol", "idempotency_key"):
        if query.get(name):
            sql.append(f"{name} = ?")
            params.append(query[name].upper() if name == "method" else query[name])
    if query.get("path"):
        sql.append("path GLOB ?")
        params.append(query["path"])
    if query.get("rule"):
        sql.append("('+' || rule_id || '+') LIKE ?")
        params.append(f"%+{query['rule']}+%")
    status = query.get("status")
    if status:
        if re.fullmatch(r"[1-5]xx", status):
            sql.append("status BETWEEN ? AND ?")
            params += [int(status[0]) * 100, int(status[0]) * 100 + 99]
        elif status == "none":
            sql.append("status IS NULL")
        elif status.isdigit():
            sql.append("status = ?")
            params.append(int(status))
        else:
            raise FilterError("status", "status must be a code (503), a class (5xx) or none (no answer sent)")
    if query.get("since"):
        sql.append("at >= ?")
        params.append(_when(query["since"], "since"))
    if query.get("until"):
        sql.append("at < ?")
        params.append(_when(query["until"], "until"))
    if query.get("after_seq"):
        try:
            params.append(int(query["after_seq"]))
        except ValueError:
            raise FilterError("after_seq", "after_seq must be an integer") from None
        sql.append("seq > ?")
    return " AND ".join(sql), params


def view(row: Any, *, detail: bool) -> dict[str, Any]:
    entry = {
        "seq": row["seq"], "at": J.rfc3339(row["at"]), "ts": row["at"], "method": row["method"], "path": row["path"],
        "channel": row["channel"], "endpoint": row["endpoint"], "rule_id": row["rule_id"], "draw": row["draw"],
        "bytes_in": row["bytes_in"], "status": row["status"], "outcome": row["outcome"], "client_ref": row["client_ref"],
        "idempotency_key": row["idempotency_key"], "job_id": row["job_id"], "retry_after": row["retry_after"],
        "duration_ms": row["duration_ms"], "protocol": row["protocol"], "input_sha256": row["input_sha256"],
    }
    if detail:
        entry["request"] = json.loads(row["request"] or "null")
        entry["response"] = json.loads(row["response"] or "null")
    return entry


def find(store: Store, query: dict[str, str], *, limit: int, detail: bool) -> list[dict[str, Any]]:
    """Matching entries, oldest first (`order=desc`: the newest first)."""
    condition, params = where(query)
    order = query.get("order", "asc")
    if order not in ("asc", "desc"):
        raise FilterError("order", "order must be asc or desc")
    rows = store.query(f"SELECT * FROM journal WHERE {condition} ORDER BY seq {order.upper()} LIMIT ?", (*params, limit))
    return [view(r, detail=detail) for r in rows]


def count(store: Store, query: dict[str, str]) -> dict[str, Any]:
    condition, params = where(query)
    total = store.query(f"SELECT COUNT(*) AS n FROM journal WHERE {condition}", tuple(params))[0]["n"]
    result: dict[str, Any] = {"count": total}
    for column in ("status", "outcome", "endpoint", "rule_id"):
        rows = store.query(f"SELECT {column} AS k, COUNT(*) AS n FROM journal WHERE {condition} GROUP BY {column}",
                           tuple(params))
        result[f"by_{column.removesuffix('_id')}"] = {str(r["k"]) if r["k"] is not None else "none": r["n"] for r in rows}
    return result
