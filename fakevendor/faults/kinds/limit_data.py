"""limit_data: Toxiproxy's limit_data: the answer cut off after N bytes, then the close."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class LimitData(Fault):
    name = "limit_data"
    stages = ("request_body", "response_headers", "response_body")
    params = (
        Param("bytes", "integer", True, 200, help="the connection closes after this many bytes"),
        Param("direction", "choice", example="downstream", choices=("downstream", "upstream"),
              help="downstream: the answer is cut (the request was processed); upstream: the request body is"),
    )
    examples = ({"bytes": 200}, {"bytes": 65536, "direction": "upstream"})
    summary = ("the request **is processed** (a create is billed); the answer stops after this many bytes, then "
               "the connection closes (`RemoteProtocolError`, a truncated body). HTTP/1.1 counts the status line "
               "and headers; HTTP/2 sends the headers and counts body bytes. `upstream`: the connection closes "
               "after this many bytes of the request body, which is **not processed**")
    processed = True

    def reading(self, decision, time_scale):
        if decision.params.get("direction") == "upstream":
            return {"reset_after": int(decision.params["bytes"]), "cut": "close"}
        return {}

    async def answer(self, ctx, decision, status, headers, body):
        if decision.params.get("direction") == "upstream":
            return None  # a request shorter than the limit goes through
        await ctx.conn.respond_truncated(status, ctx.headers(headers), body, limit=int(decision.params["bytes"]))
        return status, "limit_data"


FAULT = LimitData()
