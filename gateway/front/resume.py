"""Mid-stream resume, the pure part: what to send the next node, and how its events are
turned into the stream the client is reading.

When a node dies after a stream's first byte, the gateway sends the request's prompt token
ids (rendered and tokenized by the gateway exactly as the nodes do, ``RequestProfile``) plus
the completion token ids already streamed (``gateway.token_ids``) to another node's
``/v1/completions``, and relays what it generates as the continuation of the same stream.

Invariants:
- The continuation asks for what was left: ``max_tokens`` less the tokens already sent (none
  given: the node fills its context, as the first node would have), ``min_tokens`` less them
  too, with the request's own sampling fields, ``ignore_eos``, stop strings and
  ``response_format`` and a chat's ``tools`` (with ``resumed_tokens``: the node's grammar
  state is rebuilt over the tokens already sent); a greedy request continues with exactly the
  tokens an unbroken run gives.
- The client's stream keeps its shape: the continuation's events are rewritten in the
  client's format (chat chunks for a chat request) with the first node's ``id``,
  ``created`` and ``model``; its role chunk and empty chunks are dropped. A chat with tools
  parses the continuation's text with a parser primed by the text already streamed, so calls
  continue where they were cut (same index) and new calls get new ids.
- The final usage counts the whole answer (the original prompt, every completion token from
  every node) and says what happened: ``"edgecloud": {"resumed": n, "from": ..., "to": ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.front import fastjson
from gateway.sse import sse_event
from routing.tool_parser import ContentDelta, ToolCallParser, tool_call_entries

# sampling fields carried to the continuation (both routes accept them)
_CARRIED = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "user",
    "ignore_eos",
    "response_format",
    "tools",  # a chat's tools: the continuation follows their grammar
    "tool_choice",
    "parallel_tool_calls",
)


@dataclass(slots=True)
class StreamIdentity:
    """What the client's chunks are stamped with (from the first node's first chunk)."""

    id: str
    created: int
    model: str

    @classmethod
    def of_event(cls, event: bytes, fallback_model: str) -> StreamIdentity:
        obj: dict[str, Any] = {}
        for line in event.split(b"\n"):
            if line.startswith(b"data: {"):
                try:
                    obj = fastjson.loads(line[6:])[0]
                except ValueError:
                    obj = {}
                break
        return cls(
            str(obj.get("id", "")),
            int(obj.get("created", 0) or 0),
            str(obj.get("model", fallback_model)),
        )


@dataclass(slots=True)
class Resumed:
    """What the stream has been through: nodes, and completion tokens each sent."""

    first_node: str
    hops: list[str] = field(default_factory=list)  # nodes resumed on, in order

    def tag(self) -> dict[str, Any]:
        return {
            "resumed": len(self.hops),
            "from": self.first_node,
            "to": self.hops[-1] if self.hops else self.first_node,
            "nodes": [self.first_node, *self.hops],
        }


def continuation_body(
    body: dict[str, Any],
    prompt_ids: Sequence[int],
    sent_ids: Sequence[int],
    max_tokens: int | None,
) -> dict[str, Any] | None:
    """The ``/v1/completions`` body that continues a stream after ``sent_ids``, or None when
    nothing is left to generate."""
    left = None if max_tokens is None else max_tokens - len(sent_ids)
    if left is not None and left <= 0:
        return None
    out: dict[str, Any] = {
        "model": body["model"],
        "prompt": [*prompt_ids, *sent_ids],
        "max_tokens": left,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for k in _CARRIED:
        if body.get(k) is not None:
            out[k] = body[k]
    grammar = body.get("response_format") is not None or bool(body.get("tools"))
    if grammar:  # the grammar's state is rebuilt over the tokens sent (none: a fresh state)
        out["resumed_tokens"] = len(sent_ids)
    min_left = (body.get("min_tokens") or 0) - len(sent_ids)
    if min_left > 0:  # no stop before the request's min_tokens, counting what was sent
        out["min_tokens"] = min_left
    return out


def rewrite_event(
    event: bytes, chat: bool, ident: StreamIdentity, calls: ToolCallParser | None = None
) -> tuple[bytes, dict[str, Any] | None]:
    """One continuation event as the client's stream carries it, and its usage (if it is the
    usage chunk, returned unconverted for the caller to fix). ``b""``: nothing to send.
    ``calls``: the chat's tool-call parser, primed with the text already streamed; the text
    goes through it into content and ``tool_calls`` deltas."""
    if not event.startswith(b"data: {"):
        return event, None  # [DONE], comments
    try:
        obj = fastjson.loads(event[6:].strip())[0]
    except ValueError:
        return b"", None
    if not isinstance(obj, dict):
        return b"", None
    if "error" in obj:
        return event, None
    usage = obj.get("usage")
    choices = obj.get("choices") or []
    if not choices:
        return b"", usage if isinstance(usage, dict) else None
    c = choices[0]
    text, finish = c.get("text") or "", c.get("finish_reason")
    if not text and finish is None:
        return b"", None
    if chat:
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls is not None:
            delta, finish = tool_delta(calls, text, finish)
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        out = {
            "id": ident.id,
            "object": "chat.completion.chunk",
            "created": ident.created,
            "model": ident.model,
            "choices": [choice],
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {
            "id": ident.id,
            "object": "text_completion",
            "created": ident.created,
            "model": ident.model,
            "choices": [choice],
        }
    return sse(out), None


def primed_parser(streamed_text: str) -> ToolCallParser:
    """A tool-call parser that has consumed the text the client's stream already carried."""
    parser = ToolCallParser()
    parser.feed(streamed_text)
    return parser


def tool_delta(
    calls: ToolCallParser, text: str, finish: str | None
) -> tuple[dict[str, Any], str | None]:
    """The chat delta of ``text`` parsed by ``calls`` (content, ``tool_calls``), and the finish
    reason (``tool_calls`` for a stop after a complete call)."""
    pieces = calls.feed(text) + (calls.finish() if finish is not None else [])
    delta: dict[str, Any] = {}
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    if content:
        delta["content"] = content
    entries = tool_call_entries(pieces)
    if entries:
        delta["tool_calls"] = entries
    if finish == "stop" and calls.complete_calls:
        finish = "tool_calls"
    return delta, finish


def usage_event(
    usage: dict[str, Any], chat: bool, ident: StreamIdentity, tag: dict[str, Any]
) -> bytes:
    obj = {
        "id": ident.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": ident.created,
        "model": ident.model,
        "choices": [],
        "usage": usage,
        "edgecloud": tag,
    }
    return sse(obj)


def whole_usage(
    last: dict[str, Any], prompt_tokens: int, earlier_completion: int
) -> dict[str, Any]:
    """The usage of the whole answer from the last node's (whose prompt held the earlier
    nodes' completion tokens)."""
    completion = earlier_completion + int(last.get("completion_tokens", 0))
    details = last.get("prompt_tokens_details") or {}
    cached = min(int(details.get("cached_tokens", 0) or 0), prompt_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def tag_comment(tag: dict[str, Any]) -> bytes:
    """The SSE comment that says a stream was resumed (for clients that asked for no usage)."""
    return b": edgecloud " + json.dumps(tag, separators=(",", ":")).encode() + b"\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return sse_event(obj)
