"""response_lost: the work is done (and billed), the answer never arrives."""

from __future__ import annotations

from fakevendor.faults.base import Fault, Param

MODES = ("reset", "close", "stall", "goaway")


class ResponseLost(Fault):
    name = "response_lost"
    stages = ("response_headers",)
    params = (
        Param("mode", "choice", example="reset", choices=MODES,
              help="how the answer is lost after the work was done (and billed)"),
        Param("error_code", "integer", help="goaway: the frame's error code"),
    )
    examples = ({"mode": "reset"}, {"mode": "goaway"})
    summary = ("the job **is created and billed**, the answer never arrives (`goaway`: a GOAWAY whose "
               "last-stream-id covers this stream, \"may have been processed\": `RemoteProtocolError`)")
    processed = True

    async def answer(self, ctx, decision, status, headers, body):
        mode = decision.params.get("mode") or "reset"
        conn = ctx.conn
        if mode == "reset":
            conn.reset()
        elif mode == "close":
            conn.close()
        elif mode == "goaway":
            # "I may have processed your request": last-stream-id covers this stream.
            await conn.goaway(last_stream_id=getattr(conn, "stream_id", None),
                              error_code=int(decision.params.get("error_code") or 0))
        else:
            await conn.stall_forever()
        return status, f"response_lost:{mode}"


FAULT = ResponseLost()
