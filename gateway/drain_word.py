"""The last words of a stream cut at the drain deadline.

When a server stops (SIGTERM, SIGINT) its streams get ``drain_timeout_s`` to finish; a stream
still running then is cut. Rather than end it with a truncated chunked body, the server
(:class:`gateway.http_server.ServedApp`) writes the stream's API's error event naming the
reason, then its end, then ends the body cleanly:

- OpenAI chat and completions (any path but the two below): ``data: {"error": {...,
  "code": "server_shutting_down"}}`` then ``data: [DONE]``;
- ``/v1/messages`` (Anthropic): ``event: error`` with ``{"type": "error", "error": {"type":
  "overloaded_error", ...}}``;
- ``/v1/responses``: ``event: error`` with ``{"type": "error", "code":
  "server_shutting_down", ...}``.

Invariants: the words start on an event boundary (an event the cut left half-written is
closed first, so the error is never glued to it) and are complete events; the message says
why (the signal) and that retrying the request continues elsewhere; it names no node.
"""

from __future__ import annotations

from gateway.sse import sse_event

DRAIN_CODE = "server_shutting_down"
# How a node's drain word reads inside the gateway's relay (compact JSON, as sse_event writes).
DRAIN_MARK = f'"code":"{DRAIN_CODE}"'.encode()


def drain_message(reason: str | None, drain_s: float) -> str:
    """What the client is told: why the stream was cut, and what to do."""
    why = f" ({reason})" if reason else ""
    return (
        f"The server is shutting down{why}: this stream was cut at its {drain_s:g} s drain "
        "deadline. Retry the request to continue on another server."
    )


def drain_words(path: str, message: str, *, mid_event: bool = False) -> bytes:
    """The bytes that end a stream of ``path`` cut at the drain deadline (see the module);
    ``mid_event``: the last bytes sent did not end an event."""
    head = b"\n\n" if mid_event else b""
    if path.startswith("/v1/messages"):
        err = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        return head + b"event: error\n" + sse_event(err)
    if path.startswith("/v1/responses"):
        err = {"type": "error", "code": DRAIN_CODE, "message": message, "param": None}
        return head + b"event: error\n" + sse_event(err)
    body = {
        "error": {"message": message, "type": "server_error", "param": None, "code": DRAIN_CODE}
    }
    return head + sse_event(body) + b"data: [DONE]\n\n"
