"""The control API under /__admin/ (shared/contracts/vendor-api.md): rules, seed, reset,
amnesia, ledger, journal (find, count, one entry), in-flight requests, scenarios, invariants,
channels. Every call but `health` needs the admin token."""

from __future__ import annotations

import json
from typing import Any

from fakevendor import jobs as J
from fakevendor import journal
from fakevendor.answers import Answer, int_arg, ok, problem
from fakevendor.faults import RuleError
from fakevendor.invariants import invariants

MAX_CONTROL_BODY = 1024 * 1024


class AdminAPI:
    def __init__(self, vendor: Any) -> None:
        self.vendor = vendor

    async def handle(self, conn: Any, request: Any) -> None:
        route = request.route[1:]
        if route == ["health"]:
            await self._send(conn, ok({"ok": True, "port": self.vendor.config.port}))
            return
        if request.headers.get("authorization", "") != f"Bearer {self.vendor.config.admin_token}":
            await self.vendor.discard_body(conn, request)
            await self._send(conn, problem(401, "unauthenticated", "The admin token is required."))
            return
        body: Any = None
        if conn.body_pending:
            chunks: list[bytes] = []
            try:
                await conn.read_body(request, sink=chunks.append, limit=MAX_CONTROL_BODY)
            except OverflowError:
                await self._send(conn, problem(413, "too_large", "Control bodies up to 1 MiB."))
                return
            raw = b"".join(chunks)
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    await self._send(conn, problem(400, "invalid_json", "The body is not valid JSON.", field="body"))
                    return
        await self._send(conn, self.route(route, request.method, request, body))

    async def _send(self, conn: Any, answer: Answer) -> None:
        status, headers, body = answer
        await conn.respond(status, headers, body)

    def route(self, route: list[str], method: str, request: Any, body: Any) -> Answer:
        vendor, faults, store = self.vendor, self.vendor.faults, self.vendor.store
        if route == ["faults"]:
            if method == "GET":
                return ok({"data": [r.as_dict() for r in faults.rules], "seed": faults.seed})
            if method == "POST":
                try:
                    rule = faults.add(body)
                except RuleError as exc:
                    return problem(400, "invalid_rule", exc.message, field=exc.field)
                return ok(rule.as_dict(), 201)
            if method == "DELETE":
                count = len(faults.rules)
                faults.clear()
                return ok({"deleted": count})
        if len(route) == 2 and route[0] == "faults" and method == "DELETE":
            if faults.remove(route[1]):
                return ok({"deleted": 1})
            return problem(404, "not_found", "No rule with this id.")
        if route == ["seed"] and method == "PUT":
            seed = body.get("seed") if isinstance(body, dict) else None
            if isinstance(seed, bool) or not isinstance(seed, int):
                return problem(400, "invalid_seed", "seed must be an integer.", field="seed")
            faults.set_seed(seed)
            return ok({"seed": seed})
        if route == ["reset"] and method == "POST":
            what = body if isinstance(body, dict) else {"faults": True, "state": True, "journal": True}
            if what.get("faults"):
                faults.clear()
            store.reset(state=bool(what.get("state")), journal=bool(what.get("journal")))
            if what.get("state"):
                vendor.uploads_max.clear()
                vendor.buckets.clear()
            return ok({"reset": what})
        if route == ["amnesia"] and method == "POST":
            forgotten = store.forget()
            vendor.uploads_now.clear()
            return ok({"forgotten": forgotten})
        if route == ["ledger"] and method == "GET":
            data = [{**{k: r[k] for k in ("seq", "entry_id", "channel", "job_id", "client_ref", "idempotency_key",
                                          "units", "unit", "amount_cents", "input_sha256")},
                     "created_at": J.rfc3339(r["created_at"])}
                    for r in store.ledger()]
            return ok({"data": data})
        if route[:1] == ["journal"] and method == "GET":
            return self._journal(route[1:], request.query)
        if route == ["in-flight"] and method == "GET":
            return ok({"data": vendor.requests_in_flight()})
        if route == ["scenarios"] and method == "GET":
            return ok({"data": faults.scenarios()})
        if route == ["scenarios", "reset"] and method == "POST":
            faults.reset_scenarios()
            return ok({"data": faults.scenarios()})
        if route == ["invariants"] and method == "GET":
            return ok(invariants(store, uploads_max=vendor.uploads_max, in_flight=len(vendor.requests_now)))
        if route == ["channels"] and method == "GET":
            return ok({n: c.as_dict() for n, c in vendor.config.channels.items()})
        if len(route) == 2 and route[0] == "channels" and method in ("PUT", "GET"):
            channel = vendor.config.channel(route[1])
            if method == "PUT":
                if not isinstance(body, dict):
                    return problem(400, "invalid_channel", "Send a JSON object of settings.", field="body")
                try:
                    channel.update(body)
                except (ValueError, TypeError) as exc:
                    return problem(400, "invalid_channel", str(exc), field=str(exc).split(" ")[0])
            return ok(channel.as_dict())
        return problem(404, "not_found", "No such control endpoint.")

    def _journal(self, rest: list[str], query: dict[str, str]) -> Answer:
        """GET /__admin/journal?filters (detail=1: with headers and bodies), /journal/count?filters,
        /journal/{seq} (one entry, in full)."""
        store = self.vendor.store
        try:
            if rest == ["count"]:
                return ok(journal.count(store, query))
            if len(rest) == 1 and rest[0].isdigit():
                found = journal.find(store, {"after_seq": str(int(rest[0]) - 1)}, limit=1, detail=True)
                if not found or found[0]["seq"] != int(rest[0]):
                    return problem(404, "not_found", "No journal entry with this seq.")
                return ok(found[0])
            if rest:
                return problem(404, "not_found", "No such control endpoint.")
            limit = int_arg(query.get("limit"), 1000, 1, 100000)
            detail = query.get("detail", "") in ("1", "true", "yes")
            return ok({"data": journal.find(store, query, limit=limit, detail=detail)})
        except journal.FilterError as exc:
            return problem(400, "invalid_filter", str(exc), field=exc.field)
