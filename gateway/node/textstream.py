"""Token ids to text deltas, with stop strings, for streaming.

Invariants:
- Concatenating every delta gives ``decode(all ids)`` cut at the first stop string (the stop
  string itself excluded), so no UTF-8 character is ever split between chunks.
- Text that might be the start of a stop string is held back until it is known not to be one;
  it is released by ``flush`` when generation ends for another reason.
- No stop string ends the text before ``min_tokens`` tokens were pushed: one that is complete
  sooner is emitted as text (the engines likewise ban stop token ids until then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


@dataclass
class TextStreamer:
    """Turns one request's token ids into text deltas, cut at the first stop string."""

    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    min_tokens: int = 0
    _decoder: DecodeStream = field(init=False)
    _tokens: int = field(init=False, default=0)  # token ids pushed so far
    _pending: str = field(init=False, default="")
    stopped: bool = field(init=False, default=False)
    text: str = field(init=False, default="")  # everything emitted so far

    def __post_init__(self) -> None:
        self._decoder = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self.stop = tuple(s for s in self.stop if s)

    @property
    def holding(self) -> bool:
        """Whether text decoded so far is held back (it may start a stop string)."""
        return bool(self._pending)

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the text now safe to emit ('' if none)."""
        if self.stopped:
            return ""
        out = ""
        for tid in token_ids:
            piece = self._decoder.step(self.tokenizer, tid)
            self._tokens += 1
            if piece:
                self._pending += piece
            if self._tokens < self.min_tokens:  # no stop string may end here
                out += self._release(match=False)
        return out + self._release(match=self._tokens >= self.min_tokens)

    def _release(self, match: bool = True) -> str:
        """Emit what is known not to be (part of) a stop string; with ``match``, end at the
        first stop string in the pending text."""
        if not self.stop:
            out, self._pending = self._pending, ""
            self.text += out
            return out
        if match:
            cut = min((i for s in self.stop if (i := self._pending.find(s)) >= 0), default=-1)
            if cut >= 0:
                out = self._pending[:cut]
                self._pending = ""
                self.stopped = True
                self.text += out
                return out
        # hold back the longest suffix that is a proper prefix of some stop string
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(s[:k]):
                    hold = k
                    break
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        self.text += out
        return out

    def flush(self) -> str:
        """Release any held-back text (call when generation ended without a stop string)."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        self.text += out
        return out
