"""The native dialect (shared/contracts/vendor-api.md, `/v1/...`): uploads, jobs, results,
cancels, the usage ledger and signed callbacks. `vendor` is the FakeVendor (its store, faults,
config, clock and the behaviour both dialects share: receiving files, creating billed jobs)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from pathlib import Path
from typing import Any

from fakevendor import jobs as J
from fakevendor.answers import Answer, int_arg, json_bytes, ok, parse_time, problem
from fakevendor.config import ChannelConfig
from fakevendor.idempotency import Keys


class NativeDialect:
    def __init__(self, vendor: Any) -> None:
        self.vendor = vendor
        self.store = vendor.store
        self.keys = Keys(vendor.store)

    async def route(self, conn: Any, request: Any, channel: ChannelConfig, facts: Any, *, bandwidth: float | None,
                    reset_after: int | None) -> Answer:
        route, method = request.route, request.method
        if route == ["v1", "uploads"] and method == "POST":
            return await self._upload(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
        if route == ["v1", "jobs"] and method == "POST":
            return await self._create(conn, request, channel, facts, bandwidth=bandwidth, reset_after=reset_after)
        if route == ["v1", "jobs"] and method == "GET":
            return self._list(request)
        if route == ["v1", "usage"] and method == "GET":
            return self._usage(request)
        if len(route) >= 3 and route[:2] == ["v1", "jobs"]:
            request.job_id = route[2]
            if len(route) == 3 and method == "GET":
                return self._get(request)
            if route[3:] == ["result"] and method == "GET":
                return self._result(request)
            if route[3:] == ["cancel"] and method == "POST":
                return self._cancel(request, channel)
        await self.vendor.discard_body(conn, request)
        return problem(404, "not_found", "No such endpoint.")

    # --- uploads -------------------------------------------------------------------------------
    async def _upload(self, conn, request, channel: ChannelConfig, *, bandwidth, reset_after) -> Answer:
        received = await self.vendor.receive_file(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
        if isinstance(received[0], int):
            return received
        path, size, sha = received
        upload_id = f"up_{uuid.uuid4().hex[:20]}"
        final = path.with_name(upload_id)
        path.rename(final)
        now = time.time()
        expires = now + channel.upload_ttl_s * self.vendor.config.time_scale
        self.store.execute(
            "INSERT INTO uploads (id, channel, size, sha256, path, created_at, expires_at) VALUES (?,?,?,?,?,?,?)",
            (upload_id, request.channel, size, sha, str(final), now, expires),
        )
        return ok({"upload_id": upload_id, "size": size, "sha256": sha, "expires_at": J.rfc3339(expires)}, 201)

    # --- creates -------------------------------------------------------------------------------
    async def _create(self, conn, request, channel: ChannelConfig, facts, *, bandwidth, reset_after) -> Answer:
        name = request.channel
        key = request.headers.get("idempotency-key")
        if key is not None and (not key or len(key) > 255):
            await self.vendor.discard_body(conn, request)
            return problem(400, "invalid_request", "Idempotency-Key must be 1-255 characters.")
        effect = self.vendor.create_effect(facts, request)
        ignore_keys = bool(effect.get("ignore_keys"))
        copies = int(effect.get("copies", 1))  # one request, several billed jobs: a vendor bug
        inline = not request.headers.get("content-type", "").startswith("application/json")
        existing = None
        keyed = bool(key) and not ignore_keys
        if keyed:
            existing = self.keys.lookup(name, key)
            if existing and existing["state"] == "in_progress":
                await self.vendor.discard_body(conn, request)
                return problem(409, "idempotency_key_in_use", "A request with this key is in flight.",
                               retryable=True, extra=[("Retry-After", "1")])
            if existing is None:
                self.keys.claim(name, key)
        try:
            answer = await self._create_job(conn, request, channel, facts, key=key, existing=existing, inline=inline,
                                            copies=copies, keyed=keyed, bandwidth=bandwidth, reset_after=reset_after)
        except BaseException:
            if keyed and existing is None:
                self.keys.release(name, key)
            raise
        if keyed and existing is None and answer[0] != 201:
            # Validation failures are not stored: the client may fix the request and retry.
            self.keys.release(name, key)
        return answer

    async def _create_job(self, conn, request, channel, facts, *, key, existing, inline, copies, keyed, bandwidth,
                          reset_after) -> Answer:
        name = request.channel
        if inline:
            params = request.query
            received = await self.vendor.receive_file(conn, request, channel, bandwidth=bandwidth, reset_after=reset_after)
            if isinstance(received[0], int):
                return received
            input_path, size, sha = received
            fields = {
                "kind": params.get("kind"), "target_format": params.get("target_format"),
                "client_ref": params.get("client_ref") or "", "callback_url": params.get("callback_url") or "",
            }
            try:
                options = json.loads(params["options"]) if params.get("options") else {}
            except ValueError:
                options = None
        else:
            try:
                body = json.loads(request.body or b"{}")
            except ValueError:
                return problem(400, "invalid_request", "The body is not valid JSON.")
            if not isinstance(body, dict):
                return problem(400, "invalid_request", "The body must be a JSON object.")
            fields = {k: body.get(k) for k in ("kind", "target_format", "client_ref", "callback_url")}
            fields["client_ref"] = fields["client_ref"] or ""
            fields["callback_url"] = fields["callback_url"] or ""
            options = body.get("options") or {}
            rows = self.store.query("SELECT * FROM uploads WHERE id = ? AND channel = ?", (body.get("upload_id") or "", name))
            if not rows or rows[0]["expires_at"] < time.time():
                return problem(404, "upload_not_found", "Upload first (POST /v1/uploads); uploads expire.")
            input_path, size, sha = Path(rows[0]["path"]), rows[0]["size"], rows[0]["sha256"]
        if fields["kind"] not in J.KINDS:
            return problem(400, "invalid_request", f"kind must be one of {', '.join(J.KINDS)}.")
        if fields["target_format"] not in J.TARGETS[fields["kind"]]:
            return problem(415, "unsupported_format",
                           f"target_format for {fields['kind']}: {', '.join(J.TARGETS[fields['kind']])}.")
        if not isinstance(options, dict):
            return problem(400, "invalid_request", "options must be a JSON object.")
        if not isinstance(fields["client_ref"], str) or len(fields["client_ref"]) > 200:
            return problem(400, "invalid_request", "client_ref must be a string of at most 200 characters.")
        request.client_ref = fields["client_ref"]
        request.input_sha256 = sha
        fp = J.fingerprint(input_sha256=sha, kind=fields["kind"], target_format=fields["target_format"],
                           client_ref=fields["client_ref"], options=options)
        if existing is not None:
            if inline:
                input_path.unlink(missing_ok=True)
            if existing["fingerprint"] != fp:
                return problem(422, "idempotency_key_mismatch", "This key was used with a different request.")
            job = self.store.job(name, existing["job_id"])
            request.job_id = job["id"]
            return ok(self.view(job, time.time()), extra=[("Idempotent-Replayed", "true")])
        if channel.max_concurrent_jobs and channel.concurrency_mode == "reject":
            if self.vendor.running_jobs(name) + copies > channel.max_concurrent_jobs:
                return problem(429, "too_many_jobs", "Too many jobs in flight.", retryable=True,
                               extra=[("Retry-After", "2")])
        job_rule = self.vendor.job_fault(facts, request)
        created = [self.vendor.new_job(name, channel, fields, options, key, input_path, size, sha, job_rule)
                   for _ in range(copies)]
        first = created[0]
        request.job_id = first["id"]
        if keyed:
            self.keys.bind(name, key, fingerprint=fp, job_id=first["id"])
        return ok(self.view(first, time.time()), 201)

    # --- reads ----------------------------------------------------------------------------------
    def _job_or_404(self, request) -> dict[str, Any] | Answer:
        job = self.store.job(request.channel, request.job_id or "")
        if job is None or job["not_found_until"] > time.time():
            return problem(404, "job_not_found", "No job with this id.")
        request.client_ref, request.input_sha256 = job["client_ref"], job["input_sha256"]
        return job

    def _get(self, request) -> Answer:
        job = self._job_or_404(request)
        if isinstance(job, tuple):
            return job
        return ok(self.view(job, time.time()))

    def _list(self, request) -> Answer:
        client_ref = request.query.get("client_ref")
        if not client_ref:
            return problem(400, "invalid_request", "client_ref is required.")
        request.client_ref = client_ref
        now = time.time()
        jobs = self.store.jobs_by_client_ref(request.channel, client_ref, request.query.get("status"), now)
        limit = int_arg(request.query.get("limit"), 100, 1, 500)
        offset = int_arg(request.query.get("cursor"), 0, 0, 10**9)
        page = jobs[offset:offset + limit]
        cursor = str(offset + limit) if offset + limit < len(jobs) else None
        return ok({"data": [self.view(j, now) for j in page], "next_cursor": cursor})

    def _usage(self, request) -> Answer:
        params: list[Any] = [request.channel]
        sql = "SELECT * FROM ledger WHERE channel = ?"
        if request.query.get("client_ref"):
            sql += " AND client_ref = ?"
            params.append(request.query["client_ref"])
        if request.query.get("since"):
            since = parse_time(request.query["since"])
            if since is None:
                return problem(400, "invalid_request", "since must be an RFC 3339 time.")
            sql += " AND created_at >= ?"
            params.append(since)
        cursor = int_arg(request.query.get("cursor"), 0, 0, 10**12)
        limit = int_arg(request.query.get("limit"), 100, 1, 1000)
        sql += " AND seq > ? ORDER BY seq LIMIT ?"
        params += [cursor, limit + 1]
        rows = self.store.query(sql, tuple(params))
        data = [
            {"entry_id": r["entry_id"], "job_id": r["job_id"], "client_ref": r["client_ref"],
             "idempotency_key": r["idempotency_key"], "units": r["units"], "unit": r["unit"],
             "amount_cents": r["amount_cents"], "created_at": J.rfc3339(r["created_at"])}
            for r in rows[:limit]
        ]
        next_cursor = str(rows[limit - 1]["seq"]) if len(rows) > limit else None
        return ok({"data": data, "next_cursor": next_cursor})

    def view(self, job: dict[str, Any], now: float) -> dict[str, Any]:
        if J.job_status(job, now) == "completed":
            self._ensure_result(job)
        return J.job_view(job, now)

    def _ensure_result(self, job: dict[str, Any]) -> Path:
        path = self.store.dir / "results" / job["id"]
        if not path.exists():
            path.write_bytes(J.generate_result(job["kind"], job["target_format"], job["input_sha256"]))
        if not job.get("result_sha256"):
            data = path.read_bytes()
            job["result_sha256"] = hashlib.sha256(data).hexdigest()
            job["result_size"] = len(data)
            job["result_content_type"] = J.CONTENT_TYPES.get(job["target_format"], "application/octet-stream")
            self.store.update_job(job["id"], result_sha256=job["result_sha256"], result_size=job["result_size"],
                                  result_content_type=job["result_content_type"])
        return path

    def _result(self, request) -> Answer:
        job = self._job_or_404(request)
        if isinstance(job, tuple):
            return job
        now = time.time()
        status = J.job_status(job, now)
        if status != "completed":
            return problem(409, "not_ready", f"The job is {status}.")
        channel = self.vendor.config.channel(request.channel)
        if now > job["end_at"] + channel.result_ttl_s * self.vendor.config.time_scale:
            return problem(410, "result_expired", "The result is past its retention.")
        path = self._ensure_result(job)
        sha = job["result_sha256"]
        if job.get("digest_mismatch"):
            sha = J._flip(sha)
        self.store.update_job(job["id"], fetched_at=now)
        return 200, [("Content-Type", job["result_content_type"]), ("X-Content-SHA256", sha)], path

    def _cancel(self, request, channel: ChannelConfig) -> Answer:
        job = self._job_or_404(request)
        if isinstance(job, tuple):
            return job
        now = time.time()
        status = J.job_status(job, now)
        if status in ("completed", "failed", "canceled") or job.get("canceled_at") is not None:
            if status == "canceled" or job.get("canceled_at") is not None:
                return ok(self.view(job, now), 202)
            return problem(409, "already_finished", f"The job is already {status}.")
        when = now + self.vendor.scaled(channel.cancel_delay_ms)
        if when < job["end_at"]:
            job["canceled_at"] = when
            self.store.update_job(job["id"], canceled_at=when)
        return ok(self.view(job, now), 202)

    # --- callbacks ------------------------------------------------------------------------------
    def callback(self, job: dict[str, Any], now: float) -> tuple[bytes, dict[str, str]]:
        """A signed job event, as the contract's callbacks carry it."""
        status = J.job_status(job, now)
        event = {"event": f"job.{status}", "event_id": f"evt_{job['id']}_{status}", "job": self.view(job, now)}
        body = json_bytes(event)
        secret = self.vendor.config.channel(job["channel"]).webhook_secret.encode()
        signature = hmac.new(secret, body, hashlib.sha256).hexdigest()
        return body, {"Content-Type": "application/json", "X-Vendor-Signature": f"sha256={signature}"}
