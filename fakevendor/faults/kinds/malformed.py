"""malformed: processed, then a success nobody can read (WireMock's MALFORMED_RESPONSE_CHUNK kin)."""

from __future__ import annotations

from pathlib import Path

from fakevendor.faults.base import Fault, Param

BODIES = ("not_json", "truncated_json", "missing_fields", "wrong_types", "empty")


class Malformed(Fault):
    name = "malformed"
    stages = ("response_body",)
    params = (
        Param("body", "choice", example="not_json", choices=BODIES),
        Param("status", "integer", help="200-299: a success with a broken body", minimum=200, maximum=299),
    )
    examples = ({"body": "truncated_json", "status": 200},)
    summary = "the request **is processed** (a create is billed), then answered with a 2xx body nobody can read"
    processed = True

    async def answer(self, ctx, decision, status, headers, body):
        good = status if 200 <= status < 300 else 200
        code = int(decision.params.get("status") or good)
        kind = decision.params.get("body") or "not_json"
        await ctx.respond(code, [("Content-Type", "application/json")], garbled(kind, body))
        return code, f"malformed:{kind}"


def garbled(kind: str, good: bytes | Path) -> bytes:
    """A 2xx body a client cannot use: not JSON, cut short, without the fields, or mistyped."""
    if kind == "empty":
        return b""
    if kind == "truncated_json":
        text = good.read_bytes() if isinstance(good, Path) else good
        return text[: max(len(text) // 2, 1)]
    if kind == "missing_fields":
        return b'{"ok": true}'
    if kind == "wrong_types":
        return b'{"id": null, "status": 7, "upload_id": [], "data": "none", "client_ref": {}}'
    return b"<html><body>502 upstream sent an unexpected answer</body></html>"


FAULT = Malformed()
