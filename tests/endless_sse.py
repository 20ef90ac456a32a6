"""A server whose streams never end, under the project's real server (``DrainingServer``).

``python -m tests.endless_sse PORT DRAIN_S``: every POST answers a server-sent-event stream
that sends one event at once and then one every 50 ms forever (GETs get a plain 200), so any stream running at a
drain deadline is cut there, whatever the machine's speed. It prints how it stopped
(``ServeResult.describe``) on exit.
"""

from __future__ import annotations

import asyncio
import sys

from starlette.types import Receive, Scope, Send

from gateway.http_server import serve
from gateway.server_limits import ServerLimits
from gateway.sse import sse_event


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["method"] == "GET":  # /health, for readiness
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    n = 0
    while True:
        event = {"choices": [{"index": 0, "text": f"t{n}", "finish_reason": None}]}
        await send({"type": "http.response.body", "body": sse_event(event), "more_body": True})
        n += 1
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    port, drain = int(sys.argv[1]), float(sys.argv[2])
    result = serve(app, host="127.0.0.1", port=port, limits=ServerLimits(drain_timeout_s=drain))
    print(result.describe("endless"), flush=True)
