"""A request's reply in OpenAI's shapes, streamed (chunks) or whole, for any number of choices.

Invariants: every chunk names its choice (``index``); a choice's text and logprobs, streamed,
concatenate to what the whole reply gives; completions with ``echo`` start each choice with
the prompt's text (and, with logprobs, the prompt's entries: the first ``null``); usage counts
the prompt once and the tokens of every choice. A chat reply that may hold tool calls
(``Prepared.tools``) is parsed as it streams (``routing.tool_parser``): its calls go out as
``tool_calls`` deltas (the first of a call with its ``id``, ``type`` and name) and in the whole
message, its other text as ``content``; a choice that made a call and stopped finishes with
``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.node.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from gateway.node.service import Delta, Prepared
from gateway.openai_schema import usage
from routing.engine import TokenLogprob
from routing.tool_parser import ContentDelta, Piece, ToolCallParser, tool_call_entries


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # completions: the ids the logprobs cover
    entries: list[TokenLogprob | None] = field(default_factory=list)
    chars: int = 0  # text sent so far (completions' text offsets)
    started: bool = False  # its first delta came (the echo went out)
    finish: str | None = None
    last: Delta | None = None
    parser: ToolCallParser | None = None  # the reply may hold tool calls

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` for a stop after a complete call."""
        if reason == "stop" and self.parser is not None and self.parser.complete_calls:
            return "tool_calls"
        return reason


@dataclass
class Reply:
    """Builds one request's chunks, or its whole body, from its choices' deltas."""

    prep: Prepared
    texts: TokenTexts
    choices: list[_Choice] = field(init=False)

    def __post_init__(self) -> None:
        tools = self.prep.tools is not None
        self.choices = [
            _Choice(parser=ToolCallParser() if tools else None) for _ in self.prep.choices
        ]

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    # ---- taking deltas ---------------------------------------------------------------------
    def _take(self, d: Delta) -> tuple[str, list[int], list[TokenLogprob | None]]:
        """Record ``d``: the text, ids and entries it adds to its choice (echo included; a
        parsed choice's text goes to its parser, :meth:`_pieces` gives it)."""
        c = self.choices[d.index]
        c.last = d
        text = d.text
        ids: list[int] = []
        entries: list[TokenLogprob | None] = []
        if not c.started:
            c.started = True
            if self.prep.echo is not None:
                text = self.prep.echo + text
                if self.prep.logprobs is not None:
                    ids += self.prep.gen.prompt_token_ids
                    prompt = d.prompt_logprobs or [None] * len(ids)
                    entries += prompt
        if self.prep.logprobs is not None:
            ids += [e.token_id for e in d.logprobs]
            entries += d.logprobs
        c.text.append(text)
        c.ids += ids
        c.entries += entries
        if d.finish_reason is not None:
            c.finish = c.finish_reason(d.finish_reason)
        return text, ids, entries

    @staticmethod
    def _pieces(c: _Choice, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """A parsed choice's new content and ``tool_calls`` delta entries for ``text``."""
        assert c.parser is not None
        pieces: list[Piece] = c.parser.feed(text)
        if finished:
            pieces += c.parser.finish()
        content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
        return content, tool_call_entries(pieces)

    def _logprobs(
        self, c: _Choice, ids: list[int], entries: list[TokenLogprob | None], offset: int
    ) -> dict[str, Any] | None:
        if self.prep.logprobs is None:
            return None
        if self.prep.kind == "chat":
            return chat_logprobs([e for e in entries if e is not None], self.texts)
        return completion_logprobs(ids, entries, self.texts, offset)

    # ---- streaming ---------------------------------------------------------------------------
    def envelope(self, choices: list[dict[str, Any]], chunk: bool = True) -> dict[str, Any]:
        """The reply object around ``choices``: a stream's chunk, or (``chunk`` False) the whole."""
        p = self.prep
        chat_object = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": p.gen.request_id,
            "object": chat_object if p.kind == "chat" else "text_completion",
            "created": p.created,
            "model": p.model,
            "choices": choices,
        }

    def choice_chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        logprobs: dict[str, Any] | None = None,
        role: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.prep.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def opening(self) -> list[dict[str, Any]]:
        """The first chunk of each choice (chat: its role)."""
        return [
            self.envelope([self.choice_chunk(i, "", None, role=True)])
            for i in range(len(self.choices))
        ]

    def chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks ``d`` gives: its content (when it adds any), then its choice's finish."""
        c = self.choices[d.index]
        offset = c.chars
        text, ids, entries = self._take(d)
        c.chars += len(text)
        calls: list[dict[str, Any]] = []
        if c.parser is not None:
            text, calls = self._pieces(c, text, d.finish_reason is not None)
        out = []
        if text or ids or calls:
            lps = self._logprobs(c, ids, entries, offset)
            chunk = self.choice_chunk(d.index, text if text or not calls else None, None, lps)
            if calls:
                chunk["delta"]["tool_calls"] = calls
            out.append(self.envelope([chunk]))
        if d.finish_reason is not None:
            out.append(self.envelope([self.choice_chunk(d.index, None, c.finish)]))
        return out

    def usage(self) -> dict[str, Any]:
        """The reply's usage: the prompt once, every choice's completion tokens."""
        lasts = [c.last for c in self.choices if c.last is not None]
        first = lasts[0].event
        completion = sum(d.event.completion_tokens for d in lasts)
        return usage(first.prompt_tokens, completion, first.cached_tokens).model_dump()

    def usage_chunk(self) -> dict[str, Any]:
        obj = self.envelope([])
        obj["usage"] = self.usage()
        return obj

    # ---- whole ---------------------------------------------------------------------------
    def take(self, d: Delta) -> None:
        """Record ``d`` for :meth:`whole`."""
        text, _, _ = self._take(d)
        c = self.choices[d.index]
        if c.parser is not None:
            self._pieces(c, text, d.finish_reason is not None)

    def whole(self) -> dict[str, Any]:
        p = self.prep
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lps = self._logprobs(c, c.ids, c.entries, 0)
            if p.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if c.parser is not None:
                    if c.last is None or c.last.finish_reason is None:
                        self._pieces(c, "", True)  # a stream that ended without a finish
                    calls = [call.as_openai() for call in c.parser.calls]
                    content = "".join(c.parser.content)
                    msg = {"role": "assistant", "content": content or (None if calls else "")}
                    if calls:
                        msg["tool_calls"] = calls
                choices.append(
                    {"index": i, "message": msg, "logprobs": lps, "finish_reason": c.finish}
                )
            else:
                choices.append(
                    {"index": i, "text": text, "logprobs": lps, "finish_reason": c.finish}
                )
        return {**self.envelope(choices, chunk=False), "usage": self.usage()}
