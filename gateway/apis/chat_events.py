"""A chat-completions reply, whole or streamed, read as a few API-neutral events.

The Responses and Messages writers consume these instead of chat chunks, so each knows one
shape only. Only choice 0 is read (the translated APIs ask for one choice).

Invariants:
- A streamed reply gives, in order: :class:`TextDelta` and :class:`CallStart` /
  :class:`CallArgs` events as the chunks carry them (a call's :class:`CallStart` before its
  arguments), then :class:`Finish` once, then :class:`UsageSeen` once (when the stream carried
  usage), or a :class:`StreamFailed` in place of what is missing when the stream broke.
- A whole reply (:func:`whole_events`) gives the same events a stream of it would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.proxy import split_events


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's index among the reply's calls
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # the chat finish reason: stop, length, tool_calls, ...


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of the whole reply (prompt includes the cached part)."""

    prompt: int
    completion: int
    cached: int

    @classmethod
    def of(cls, u: dict[str, Any] | None) -> Usage:
        u = u or {}
        details = u.get("prompt_tokens_details") or {}
        return cls(
            int(u.get("prompt_tokens") or 0),
            int(u.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0),
        )


@dataclass(frozen=True, slots=True)
class UsageSeen:
    usage: Usage


@dataclass(frozen=True, slots=True)
class StreamFailed:
    message: str
    code: str | None


ChatEvent = TextDelta | CallStart | CallArgs | Finish | UsageSeen | StreamFailed


def whole_events(reply: dict[str, Any]) -> list[ChatEvent]:
    """The events of a whole ``chat.completion`` body."""
    out: list[ChatEvent] = []
    choice = (reply.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    if msg.get("content"):
        out.append(TextDelta(msg["content"]))
    for i, call in enumerate(msg.get("tool_calls") or ()):
        fn = call.get("function") or {}
        out.append(CallStart(i, str(call.get("id")), str(fn.get("name"))))
        out.append(CallArgs(i, str(fn.get("arguments") or "")))
    out.append(Finish(str(choice.get("finish_reason") or "stop")))
    out.append(UsageSeen(Usage.of(reply.get("usage"))))
    return out


class ChatStreamReader:
    """Reads a chat SSE stream's bytes (whole events, as the relay yields them) as events."""

    def __init__(self) -> None:
        self._pending = b""
        self.finished = False  # a finish reason came
        self.ended = False  # [DONE] or an error event came

    def feed(self, data: bytes) -> list[ChatEvent]:
        data = self._pending + data
        self._pending = b""
        events = split_events(data)
        if events and not events[-1].endswith(b"\n\n"):
            self._pending = events.pop()
        out: list[ChatEvent] = []
        for ev in events:
            out += self._event(ev)
        return out

    def close(self) -> list[ChatEvent]:
        """Events owed when the stream ended: a failure if it ended before its end."""
        if self.ended:
            return []
        self.ended = True
        return [StreamFailed("the stream ended before it finished", "upstream_error")]

    def _event(self, ev: bytes) -> list[ChatEvent]:
        line = ev.strip()
        if not line.startswith(b"data:"):
            return []  # a comment (the resume tag) or a blank
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.ended = True
            return []
        obj = json.loads(payload)
        if "error" in obj:
            self.ended = True
            err = obj.get("error") or {}
            return [StreamFailed(str(err.get("message")), err.get("code"))]
        out: list[ChatEvent] = []
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out.append(TextDelta(delta["content"]))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if "id" in call:
                    out.append(CallStart(call["index"], call["id"], fn.get("name", "")))
                if fn.get("arguments"):
                    out.append(CallArgs(call["index"], fn["arguments"]))
            if choice.get("finish_reason"):
                self.finished = True
                out.append(Finish(choice["finish_reason"]))
        if obj.get("usage"):
            out.append(UsageSeen(Usage.of(obj["usage"])))
        return out
