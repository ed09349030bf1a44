"""close: the connection closed without an answer."""

from __future__ import annotations

from fakevendor.faults.base import Fault


class Close(Fault):
    name = "close"
    stages = ("request_headers",)
    summary = "`RemoteProtocolError: Server disconnected without sending a response`; not processed"
    processed = False

    async def before(self, ctx, decision):
        await ctx.discard_body()
        ctx.conn.close()
        return None, "close"


FAULT = Close()
