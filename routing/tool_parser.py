"""A reply's text split, as it streams, into content and Hermes tool calls (``routing.tools``).

Invariants:
- Fed a reply's text in any pieces, :class:`ToolCallParser` gives the same content, calls,
  names and arguments (its pieces concatenated) as fed whole; nothing is given twice.
- Content never holds a call's text: text that may be the start of ``<tool_call>`` is held back
  until the next piece decides it. Whitespace between calls is dropped.
- A call is announced (:class:`CallStart`, with a fresh ``call_`` id) once its name is known;
  its arguments follow as :class:`ArgsDelta` pieces, holding back the ``}`` that may close the
  call's object. At :meth:`ToolCallParser.finish`, what was held back is given: a call cut
  before its arguments begin becomes content, a call cut in its arguments keeps its partial arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from routing.tools import CALL_CLOSE, CALL_OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\}\s*$")


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    text: str


Piece = ContentDelta | CallStart | ArgsDelta


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def as_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallParser:
    """One choice's parser: :meth:`feed` each text delta, :meth:`finish` at the end."""

    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _state: Literal["text", "head", "args", "between"] = "text"
    _buf: str = ""

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, "_step_" + self._state)(out)
            if (self._state, len(self._buf)) == before:
                return out

    def finish(self) -> list[Piece]:
        """What was held back: the rest of the text or of a call's arguments."""
        out: list[Piece] = []
        rest, self._buf = self._buf, ""
        if self._state == "head":
            rest = CALL_OPEN + rest
        if self._state == "args":
            keep = _closing_suffix(rest)
            if keep and "<" in rest[len(rest) - keep :]:  # the close tag began: drop the wrapper
                rest = rest[: len(rest) - keep]
            self._args(out, rest)
        elif rest and (self._state != "between" or rest.strip()):
            self._content(out, rest)
        self._state = "text"
        return out

    @property
    def complete_calls(self) -> int:
        return sum(c.complete for c in self.calls)

    # ---- states ---------------------------------------------------------------------------
    def _step_text(self, out: list[Piece]) -> None:
        at = self._buf.find(CALL_OPEN)
        if at >= 0:
            self._content(out, self._buf[:at])
            self._buf = self._buf[at + len(CALL_OPEN) :]
            self._state = "head"
            return
        keep = _partial_suffix(self._buf, CALL_OPEN)
        self._content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]

    def _step_head(self, out: list[Piece]) -> None:
        m = _HEAD.match(self._buf)
        if m is None:
            return
        name = json.loads(f'"{m.group(1)}"')
        call = ParsedCall(new_call_id(), name)
        self.calls.append(call)
        out.append(CallStart(len(self.calls) - 1, call.id, name))
        self._buf = self._buf[m.end() :]
        self._state = "args"

    def _step_args(self, out: list[Piece]) -> None:
        at = self._buf.find(CALL_CLOSE)
        if at >= 0:
            body = _TAIL.sub("", self._buf[:at].rstrip())  # the call object's own "}"
            self._args(out, body)
            self.calls[-1].complete = True
            self._buf = self._buf[at + len(CALL_CLOSE) :]
            self._state = "between"
            return
        keep = _closing_suffix(self._buf)
        self._args(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]

    def _step_between(self, out: list[Piece]) -> None:
        stripped = self._buf.lstrip()
        if stripped.startswith(CALL_OPEN):
            self._buf = stripped[len(CALL_OPEN) :]
            self._state = "head"
        elif stripped and not CALL_OPEN.startswith(stripped):
            self._buf = stripped
            self._state = "text"
        elif len(stripped) != len(self._buf):
            self._buf = stripped

    # ---- output ---------------------------------------------------------------------------
    def _content(self, out: list[Piece], text: str) -> None:
        if text:
            self.content.append(text)
            out.append(ContentDelta(text))

    def _args(self, out: list[Piece], text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            out.append(ArgsDelta(len(self.calls) - 1, text))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _closing_suffix(text: str) -> int:
    """The length of the suffix of a call's arguments that may be its closing ``}`` (then
    whitespace and a prefix of ``</tool_call>``), 0 if none."""
    at = text.rfind("}")
    if at < 0:
        return 0
    tail = text[at + 1 :].lstrip()
    if tail and not CALL_CLOSE.startswith(tail):
        return 0
    return len(text) - at


def tool_call_entries(pieces: list[Piece]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` delta entries for ``pieces``: a call's first entry has its
    ``id``, ``type`` and name, arguments add up per ``index``."""
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        if isinstance(p, CallStart):
            fn = {"name": p.name, "arguments": ""}
            calls[p.index] = {"index": p.index, "id": p.id, "type": "function", "function": fn}
        elif isinstance(p, ArgsDelta):
            entry = calls.setdefault(p.index, {"index": p.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += p.text
    return list(calls.values())
