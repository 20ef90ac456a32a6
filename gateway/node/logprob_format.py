"""Engine log-probabilities in OpenAI's shapes: chat's ``logprobs.content`` entries and the
completions API's ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

Invariants: a token's text is its own bytes decoded as UTF-8 (byte-level BPE tokens are mapped
back to their bytes; other tokenizers decode the id alone); a token that is not valid UTF-8 by
itself (part of a character) is written ``bytes:\\xNN...`` as OpenAI does, and chat entries
carry the exact ``bytes`` either way. Completions' ``top_logprobs`` hold the top k and the
chosen token (as vLLM); chat's hold exactly the top k (as OpenAI).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer

from routing.engine import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass
class TokenTexts:
    """Each token id's bytes and text, computed once per id."""

    tokenizer: Tokenizer
    _byte_level: bool = field(init=False)
    _cache: dict[int, tuple[str, list[int]]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw = self._bytes(token_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        out = (text, list(raw))
        self._cache[token_id] = out
        return out

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object for ``entries``."""
    content = []
    for e in entries:
        text, raw = texts.get(e.token_id)
        top = []
        for tid, lp in e.top:
            t, b = texts.get(tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    texts: TokenTexts,
    offset: int = 0,
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` object: one position per id of ``token_ids``, with
    its entry (None: no log-probability, the echoed prompt's first token: ``null``); text
    offsets count from 0."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, e in zip(token_ids, entries, strict=True):
        text, _ = texts.get(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(e.logprob)
        top = {texts.get(t)[0]: lp for t, lp in e.top}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
