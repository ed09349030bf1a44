"""The fake vendor speaking AssemblyAI's v2 API under `/{channel}/v2/...` (e.g. `/assemblyai/v2/...`).

Faithful to what the vendor publishes and what its own Python SDK expects: `Authorization: <key>`
(no Bearer), `POST /v2/upload` → 200 `{"upload_url"}`, `POST /v2/transcript` → 200 Transcript (no
idempotency key, no client reference: every create is a new, billed transcript; unknown fields
are refused, as the vendor's schema forbids them), `GET /v2/transcript/{id}`, `GET /v2/transcript`
(newest first, `page_details` with prev_url/next_url carrying before_id/after_id), `DELETE` (only a
finished transcript; its audio_url becomes "http://deleted_by_user"), `/srt` and `/vtt`, errors as
`{"error": "..."}`, and webhooks `{"transcript_id", "status"}` with the auth header asked for.

The same fault engine, journal, ledger and invariants as the native dialect apply: rules name
these endpoints (`POST /v2/transcript`, `GET /v2/transcript/*`, ...) or use ENDPOINTS to
translate a native rule.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fakevendor import jobs as J

# The native endpoint a rule names, and its equivalent here.
ENDPOINTS = {
    "POST /v1/uploads": "POST /v2/upload",
    "POST /v1/jobs": "POST /v2/transcript",
    "GET /v1/jobs": "GET /v2/transcript",
    "GET /v1/jobs/*": "GET /v2/transcript/*",
    "GET /v1/jobs/*/result": "GET /v2/transcript/*/srt",
    "POST /v1/jobs/*/cancel": "DELETE /v2/transcript/*",
}
STATUS = {"queued": "queued", "processing": "processing", "completed": "completed", "failed": "error", "canceled": "error"}
# Fields of TranscriptParams (the vendor refuses any other).
PARAMS = frozenset("""
audio_url language_code punctuate format_text dual_channel multichannel webhook_url webhook_auth_header_name
webhook_auth_header_value audio_start_from audio_end_at word_boost boost_param filter_profanity redact_pii
redact_pii_audio redact_pii_audio_quality redact_pii_audio_options redact_pii_policies redact_pii_sub
redact_pii_return_unredacted speaker_labels speakers_expected speaker_options content_safety
content_safety_confidence iab_categories custom_spelling disfluencies sentiment_analysis auto_chapters
entity_detection summarization summary_model summary_type auto_highlights language_detection
language_confidence_threshold language_detection_options speech_threshold speech_model speech_models prompt
temperature remove_audio_tags keyterms_prompt keyterms_prompt_options language_codes domain
""".split())
SPEECH_MODELS = ("best", "nano", "slam-1", "universal")
DELETED = "http://deleted_by_user"
Answer = tuple[int, list[tuple[str, str]], bytes | Path]


def error(status: int, message: str, extra: list[tuple[str, str]] | None = None) -> Answer:
    return status, [("Content-Type", "application/json"), *(extra or [])], json.dumps({"error": message}).encode()


def _json(data: Any) -> Answer:
    return 200, [("Content-Type", "application/json")], json.dumps(data).encode()


def authorized(headers: dict[str, str], keys: tuple[str, ...]) -> bool:
    return headers.get("authorization", "") in keys


def _when(ts: float | None) -> str | None:
    # The vendor's timestamps: ISO 8601 with microseconds, UTC.
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ") if ts is not None else None


class AssemblyAIDialect:
    """Routes of the v2 API; `vendor` is the FakeVendor (its store, faults, config, clock)."""

    def __init__(self, vendor: Any) -> None:
        self.vendor = vendor

    async def route(self, conn: Any, request: Any, channel: Any, facts: Any, *, bandwidth: float | None,
                    reset_after: int | None) -> Answer:
        route, method = request.route, request.method
        if route == ["v2", "upload"] and method == "POST":
            return await self._upload(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
        if route == ["v2", "transcript"] and method == "POST":
            return self._create(request, channel, facts)
        if route == ["v2", "transcript"] and method == "GET":
            return self._list(request)
        if len(route) >= 3 and route[:2] == ["v2", "transcript"]:
            if len(route) == 3 and method == "GET":
                return self._get(request)
            if len(route) == 3 and method == "DELETE":
                return self._delete(request)
            if len(route) == 4 and route[3] in ("srt", "vtt") and method == "GET":
                return self._subtitles(request, route[3])
        await self.vendor.discard_body(conn, request)
        return error(404, "Not found")

    # --- uploads -----------------------------------------------------------------------------
    async def _upload(self, conn: Any, request: Any, channel: Any, *, bandwidth: float | None,
                      reset_after: int | None) -> Answer:
        received = await self.vendor.receive_file(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
        if isinstance(received[0], int):
            status, _, body = received
            message = json.loads(body).get("detail", "Upload failed") if body else "Upload failed"
            return error(status, message)
        path, size, sha = received
        upload_id = str(uuid.uuid4())
        final = path.with_name(f"up_{upload_id}")
        path.rename(final)
        now = time.time()
        self.vendor.store.execute(
            "INSERT INTO uploads (id, channel, size, sha256, path, created_at, expires_at) VALUES (?,?,?,?,?,?,?)",
            (upload_id, request.channel, size, sha, str(final), now, now + channel.upload_ttl_s * self.vendor.config.time_scale),
        )
        return _json({"upload_url": f"{self._base(request)}/v2/upload/{upload_id}"})

    def _base(self, request: Any) -> str:
        host = request.headers.get("host") or f"127.0.0.1:{self.vendor.config.port}"
        prefix = "" if request.channel == "default" else f"/{request.channel}"
        return f"http://{host}{prefix}"

    # --- transcripts ---------------------------------------------------------------------------
    def _create(self, request: Any, channel: Any, facts: Any) -> Answer:
        try:
            body = json.loads(request.body or b"")
        except ValueError:
            return error(400, "The request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "The request body must be a JSON object")
        unknown = sorted(set(body) - PARAMS)
        if unknown:
            return error(400, f"Unknown field(s): {', '.join(unknown)}")
        audio_url = body.get("audio_url")
        if not isinstance(audio_url, str) or not audio_url:
            return error(400, "audio_url is required")
        model = body.get("speech_model")
        if model is not None and model not in SPEECH_MODELS:
            return error(400, f"speech_model must be one of {', '.join(SPEECH_MODELS)}")
        for name in ("webhook_url", "webhook_auth_header_name", "webhook_auth_header_value", "language_code"):
            if body.get(name) is not None and not isinstance(body[name], str):
                return error(400, f"{name} must be a string")
        upload = self._upload_of(request.channel, audio_url)
        copies = int(self.vendor.create_effect(facts, request).get("copies", 1))
        job_rule = self.vendor.job_fault(facts, request)
        extra = {
            "dialect": "assemblyai", "audio_url": audio_url, "language_code": body.get("language_code") or "en_us",
            "speech_model": model, "webhook_auth_header_name": body.get("webhook_auth_header_name"),
            "webhook_auth_header_value": body.get("webhook_auth_header_value"),
        }
        fields = {"kind": "transcription", "target_format": "txt", "client_ref": "",
                  "callback_url": body.get("webhook_url") or ""}
        if upload is None:
            # The vendor fetches the URL itself; one it cannot download ends in status "error".
            fields_fail = dict(fail_code=f"Download error, unable to download {audio_url[:200]}")
            input_path, size, sha = Path("/nonexistent"), 0, ""
        else:
            fields_fail = {}
            input_path, size, sha = Path(upload["path"]), upload["size"], upload["sha256"]
        created = []
        for _ in range(copies):
            job = self.vendor.new_job(request.channel, channel, fields, {}, "", input_path, size, sha, job_rule,
                                       extra=extra, bill=upload is not None, **fields_fail)
            created.append(job)
        request.job_id, request.input_sha256 = created[0]["id"], sha or None
        return _json(self.transcript(created[0], time.time()))

    def _upload_of(self, channel: str, audio_url: str) -> dict[str, Any] | None:
        path = urlsplit(audio_url).path.rstrip("/").split("/")
        if len(path) < 2 or path[-2] != "upload":
            return None
        rows = self.vendor.store.query("SELECT * FROM uploads WHERE id = ? AND channel = ?", (path[-1], channel))
        return dict(rows[0]) if rows and rows[0]["expires_at"] >= time.time() else None

    def _job(self, request: Any) -> dict[str, Any] | Answer:
        job = self.vendor.store.job(request.channel, request.job_id or "")
        if job is None or job["not_found_until"] > time.time() or _extra(job).get("dialect") != "assemblyai":
            return error(404, "Transcript lookup error, transcript id not found")
        request.input_sha256 = job["input_sha256"] or None
        return job

    def _get(self, request: Any) -> Answer:
        job = self._job(request)
        if isinstance(job, tuple):
            return job
        now = time.time()
        if J.job_status(job, now) == "completed" and not _extra(job).get("deleted"):
            self.vendor.store.update_job(job["id"], fetched_at=now)
        return _json(self.transcript(job, now))

    def _delete(self, request: Any) -> Answer:
        job = self.vendor.store.job(request.channel, request.job_id or "")
        if job is None or _extra(job).get("dialect") != "assemblyai":
            return error(400, "Transcript lookup error, transcript id not found")
        now = time.time()
        if J.job_status(job, now) in ("queued", "processing"):
            return error(400, "Transcript is still being processed; only a completed or failed transcript can be deleted")
        extra = {**_extra(job), "deleted": True, "audio_url": DELETED, "had_webhook": bool(job.get("callback_url"))}
        self.vendor.store.update_job(job["id"], extra=json.dumps(extra), callback_url="")
        job["extra"] = json.dumps(extra)
        return _json(self.transcript(job, now))

    def _subtitles(self, request: Any, fmt: str) -> Answer:
        job = self._job(request)
        if isinstance(job, tuple):
            return job
        now = time.time()
        status = J.job_status(job, now)
        if status != "completed" or _extra(job).get("deleted"):
            return error(400, f"Transcript is not completed (status {STATUS[status]})")
        self.vendor.store.update_job(job["id"], fetched_at=now)
        data = J.generate_result("transcription", fmt, job["input_sha256"])
        path = self.vendor.store.dir / "results" / f"{job['id']}.{fmt}"
        path.write_bytes(data)
        return 200, [("Content-Type", "text/plain")], path

    def _list(self, request: Any) -> Answer:
        query = request.query
        try:
            limit = int(query.get("limit", "10"))
        except ValueError:
            return error(400, "limit must be an integer")
        if not 1 <= limit <= 200:
            return error(400, "limit must be between 1 and 200")
        status = query.get("status")
        if status is not None and status not in ("queued", "processing", "completed", "error"):
            return error(400, "status must be queued, processing, completed or error")
        now = time.time()
        rows = [dict(r) for r in self.vendor.store.query(
            "SELECT * FROM jobs WHERE channel = ? ORDER BY created_at DESC, id DESC", (request.channel,))]
        rows = [r for r in rows if _extra(r).get("dialect") == "assemblyai"]
        if status:
            rows = [r for r in rows if STATUS[J.job_status(r, now)] == status]
        order = {r["id"]: i for i, r in enumerate(rows)}
        if query.get("before_id") in order:
            rows = rows[order[query["before_id"]] + 1:]
        elif query.get("after_id") in order:
            rows = rows[:order[query["after_id"]]][-limit:]
        page = rows[:limit]
        base = f"{self._base(request)}/v2/transcript"
        params = {k: v for k, v in query.items() if k not in ("before_id", "after_id")}
        current = f"{base}?{urlencode(query)}" if query else base
        older = page and len(rows) > len(page)
        newer = page and order and order[page[0]["id"]] > 0
        return _json({
            "page_details": {
                "limit": limit, "result_count": len(page), "current_url": current,
                "prev_url": f"{base}?{urlencode({**params, 'before_id': page[-1]['id']})}" if older else None,
                "next_url": f"{base}?{urlencode({**params, 'after_id': page[0]['id']})}" if newer else None,
            },
            "transcripts": [self.list_item(r, now, base) for r in page],
        })

    # --- views ---------------------------------------------------------------------------------
    def transcript(self, job: dict[str, Any], now: float) -> dict[str, Any]:
        extra = _extra(job)
        status = STATUS[J.job_status(job, now)]
        deleted = bool(extra.get("deleted"))
        completed = status == "completed"
        text = None
        if completed:
            text = "Deleted by user." if deleted else J.generate_result("transcription", "txt", job["input_sha256"]).decode().strip()
        duration = J.wav_duration_s(Path(job["input_path"])) if completed and not deleted else None
        view: dict[str, Any] = {
            "id": job["id"], "status": status, "audio_url": extra.get("audio_url") or "",
            "language_model": "assemblyai_default", "acoustic_model": "assemblyai_default",
            "language_code": extra.get("language_code") or "en_us", "speech_model": extra.get("speech_model"),
            "text": text, "words": [] if completed and not deleted else None, "utterances": None,
            "confidence": 0.93 if completed and not deleted else None,
            "audio_duration": int(duration) if duration is not None else None,
            "punctuate": True, "format_text": True, "dual_channel": None,
            "webhook_url": DELETED if deleted and extra.get("had_webhook") else (job.get("callback_url") or None),
            "webhook_status_code": extra.get("webhook_status_code"), "webhook_auth": bool(extra.get("webhook_auth_header_name")),
            "webhook_auth_header_name": None if deleted else extra.get("webhook_auth_header_name"),
            "auto_highlights": False, "redact_pii": False, "summarization": False, "speaker_labels": False,
            "throttled": None,
        }
        if status == "error":
            view["error"] = job.get("fail_code") or "Transcription failed"
        return view

    def list_item(self, job: dict[str, Any], now: float, base: str) -> dict[str, Any]:
        status = STATUS[J.job_status(job, now)]
        return {
            "id": job["id"], "resource_url": f"{base}/{job['id']}", "status": status,
            "created": _when(job["created_at"]), "completed": _when(J.job_end(job)) if status in ("completed", "error") else None,
            "audio_url": _extra(job).get("audio_url") or "", "error": (job.get("fail_code") or "Transcription failed")
            if status == "error" else None,
        }

    def callback(self, job: dict[str, Any], now: float) -> tuple[bytes, dict[str, str]]:
        """The webhook body and headers for a finished transcript."""
        extra = _extra(job)
        body = json.dumps({"transcript_id": job["id"], "status": STATUS[J.job_status(job, now)]}).encode()
        headers = {"Content-Type": "application/json"}
        if extra.get("webhook_auth_header_name") and extra.get("webhook_auth_header_value"):
            headers[extra["webhook_auth_header_name"]] = extra["webhook_auth_header_value"]
        return body, headers


def _extra(job: dict[str, Any]) -> dict[str, Any]:
    raw = job.get("extra") or ""
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}


def translate_rule(rule: dict[str, Any]) -> dict[str, Any]:
    """A native rule for this dialect: its endpoint renamed; criteria it cannot have dropped."""
    translated = dict(rule)
    translated["endpoint"] = ENDPOINTS.get(rule.get("endpoint", "* *"), rule.get("endpoint", "* *"))
    match = {k: v for k, v in (rule.get("match") or {}).items() if k not in ("client_ref", "idempotency_key")}
    if rule.get("match"):
        translated["match"] = match
    return translated

