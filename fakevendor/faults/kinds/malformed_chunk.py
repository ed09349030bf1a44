"""malformed_chunk: WireMock's MALFORMED_RESPONSE_CHUNK: a success status, then garbage instead
of the body's framing, then the close."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param


class MalformedChunk(Fault):
    name = "malformed_chunk"
    stages = ("response_headers", "response_body")
    params = (Param("bytes", "integer", example=64, minimum=1, help="garbage bytes after the headers"),)
    examples = ({}, {"bytes": 256})
    summary = ("the request **is processed** (a create is billed); the status line and headers of a chunked 200 "
               "arrive, then random bytes where the first chunk should be, then the close: the client has a "
               "status and no readable body (`RemoteProtocolError`). HTTP/2: the headers, a DATA frame of "
               "random bytes shorter than announced, then the connection closes (`ReadError`)")
    processed = True

    async def answer(self, ctx, decision, status, headers, body):
        size = int(decision.params.get("bytes") or 64)
        await ctx.conn.respond_malformed_chunk(200, ctx.headers([h for h in headers if h[0].lower() != "content-length"]),
                                               bytes(decision.rng.getrandbits(8) for _ in range(size)))
        return 200, "malformed_chunk"


FAULT = MalformedChunk()
