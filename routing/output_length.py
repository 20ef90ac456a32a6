"""Learned expected output length: :class:`OutputLengthEstimator` and its knobs
(:class:`OutputKnobs`). Each statistic is an EWMA of the logarithm of completion tokens, kept in
this process only (its keys are Python hashes) and LRU-bounded at ``max_keys``; an estimate is
in ``[1, max_tokens]`` (when set), the default until a statistic has enough samples, and an
answer cut at its cap counts only as a lower bound on its prompt's own length.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from pydantic import BaseModel, ConfigDict, Field

from routing.request_body import MAX_TOKENS


class OutputKnobs(BaseModel):
    """Expected-output-length knobs (one section of the policy YAML)."""

    model_config = ConfigDict(extra="forbid")

    default_tokens: float = Field(default=128.0, gt=0)
    alpha: float = Field(default=0.2, gt=0, le=1)
    min_samples: int = Field(default=1, ge=1, description="samples before the EWMA is used")
    max_keys: int = Field(default=10_000, ge=1, description="LRU bound on (key, route) pairs")
    whole_prompt: bool = Field(
        default=True, description="a prompt sent again is predicted by its own answers first"
    )
    last_message: bool = Field(
        default=True,
        description="next, requests of one app (first prompt block) and cap whose last message "
        "is the same (a question asked in many chats, or with other histories) are predicted by "
        "each other's answers",
    )
    length_bucket: bool = Field(
        default=True,
        description="next, requests of one app and cap with prompts of like length (within a "
        "power of two) are predicted by each other's answers: a document to summarize and a "
        "one-line question under one app answer at other lengths",
    )


class OutputLengthEstimator:
    """EWMA of the logarithm of completion tokens (their geometric mean) per (API key, route,
    whole prompt, node kind), per (API key, route, whole prompt), per (API key, route,
    max_tokens, first prompt block) and its last message, and its prompt length's power of two,
    per (API key, route, max_tokens, first prompt block), per (API key, route, max_tokens) and
    per (API key, route), LRU-bounded; a default until learned.

    A prompt sent again (an automation's fixed request, a retried question) is best predicted
    by its own earlier answers: under greedy decoding the length repeats, so that statistic
    answers after one sample, whatever ``max_tokens`` the request sets. It repeats on one
    engine: the edge's int8 ONNX graph and the cloud's torch model can answer the same prompt
    at other lengths (the same words, then one token apart), so the whole prompt's statistic is
    kept per node kind first, and across kinds for a kind that has not answered it yet. It
    keeps answers that ended on their own (fewer tokens than their ``max_tokens``) apart from
    answers cut at their cap, which only say the natural length is at least that cap: a prompt
    that stopped at 7 tokens under a cap of 16 is predicted at 7 under a cap of 32, and one cut
    at 16 is predicted at 16 or more, until the prompt ends on its own again there (the same
    prompt's greedy answer can change with the numerics of its run: the edge answered one
    question at 16 tokens cold and at 7 with its prefix reused, and a bound kept for good
    predicted 16 for every later 7). Otherwise apps send one ``max_tokens`` per feature (a
    one-line answer, a summary, code) and one system prompt per feature, whose first block
    hash names it; requests alike in both are the best guide to each other. Within one app
    the same last message (a question asked in many chats) and then a like prompt length (a
    document to summarize against a one-line question) tell requests apart further: a template
    that adds a default system prompt gives every request without one the same first block,
    and the benchmark's mix then pooled one-word answers, 16-token chat turns and summaries
    the int8 edge ends at once. The most specific statistic with enough samples answers
    (``min_samples`` for all but the whole prompt).
    """

    _ANY = -1  # the max_tokens or prefix slot of a coarser statistic

    def __init__(self, knobs: OutputKnobs | None = None) -> None:
        self.knobs = knobs or OutputKnobs()
        self._stats: OrderedDict[tuple[str, str, int, int], tuple[float, int]] = OrderedDict()

    def configure(self, knobs: OutputKnobs) -> None:
        self.knobs = knobs
        self._trim()

    @staticmethod
    def _to_stat(tokens: float) -> float:
        return math.log(max(1.0, tokens))

    @staticmethod
    def _from_stat(value: float) -> float:
        # rounded: a length seen once (or always the same) comes back as that whole number
        return round(math.exp(value), 6)

    def _used(
        self, prompt: int | None, last: int | None, prompt_tokens: int | None
    ) -> tuple[int | None, int | None, int | None]:
        """The whole prompt's key, the last message's and the prompt's length, where the knobs
        use them."""
        k = self.knobs
        return (
            prompt if k.whole_prompt else None,
            last if k.last_message else None,
            prompt_tokens if k.length_bucket else None,
        )

    def _trim(self) -> None:
        while len(self._stats) > self.knobs.max_keys:
            self._stats.popitem(last=False)

    @classmethod
    def _prompt_keys(
        cls, key: str, route: str, prompt: int, kind: str | None, suffix: str = ""
    ) -> list[tuple[str, str, int, int]]:
        """The whole prompt's statistics (``suffix`` "-cut": its cut answers), the node
        kind's first; they live in the prefix slot under routes of their own."""
        out = [(key, f"{route}#prompt{suffix}@{kind}", cls._ANY, prompt)] if kind else []
        return [*out, (key, f"{route}#prompt{suffix}", cls._ANY, prompt)]

    @classmethod
    def _keys(
        cls,
        api_key: str | None,
        route: str,
        max_tokens: int | None,
        prefix: int | None,
        prompt: int | None = None,
        kind: str | None = None,
        last: int | None = None,
        prompt_tokens: int | None = None,
    ) -> tuple[int, list[tuple[str, str, int, int]]]:
        """The statistics a request belongs to, most specific first, and how many of them
        (first) are the whole prompt's. ``last`` names its last message, ``prompt_tokens``
        its length for the app's statistic by length (None: not used)."""
        key, any_ = api_key or "", cls._ANY
        cap = max_tokens if max_tokens is not None and 0 < max_tokens <= MAX_TOKENS else any_
        out = [] if prompt is None else cls._prompt_keys(key, route, prompt, kind)
        whole = len(out)
        if cap != any_ and prefix is not None:
            if last is not None:
                out.append((key, f"{route}#last", cap, hash((prefix, last))))
            if prompt_tokens is not None and prompt_tokens > 0:
                out.append((key, f"{route}#len{prompt_tokens.bit_length()}", cap, prefix))
            out.append((key, route, cap, prefix))
        if cap != any_:
            out.append((key, route, cap, any_))
        out.append((key, route, any_, any_))
        return whole, out

    def expected(
        self,
        api_key: str | None,
        route: str,
        max_tokens: int | None = None,
        prefix: int | None = None,
        prompt: int | None = None,
        kind: str | None = None,
        last: int | None = None,
        prompt_tokens: int | None = None,
    ) -> float:
        """The expected completion tokens on a node of ``kind`` (None: any kind).

        The whole prompt's answers on this kind, else on any kind, come first (their own
        length, and at least the longest cap they were cut at); the first of the two levels
        that has seen the prompt decides, then the coarser statistics."""
        value = self.knobs.default_tokens
        prompt, last, prompt_tokens = self._used(prompt, last, prompt_tokens)
        whole, keys = self._keys(
            api_key, route, max_tokens, prefix, prompt, kind, last, prompt_tokens
        )
        cuts = (
            [] if prompt is None else self._prompt_keys(api_key or "", route, prompt, kind, "-cut")
        )
        at_least, known = 0.0, False  # the longest cap this prompt's answers were cut at
        for natural, cut in zip(keys[:whole], cuts, strict=True):
            stat, bound = self._stats.get(natural), self._stats.get(cut)
            if stat is None and bound is None:
                continue
            at_least = bound[0] if bound is not None else 0.0
            if stat is not None:
                value, known = self._from_stat(stat[0]), True
            break
        if not known:
            for k in keys[whole:]:
                stat = self._stats.get(k)
                if stat is not None and stat[1] >= self.knobs.min_samples:
                    value = self._from_stat(stat[0])
                    break
        value = max(value, at_least)
        if max_tokens is not None and max_tokens < value:  # int vs float: exact, never overflows
            value = float(max_tokens)
        return max(1.0, value)

    def observe(
        self,
        api_key: str | None,
        route: str,
        completion_tokens: int,
        max_tokens: int | None = None,
        prefix: int | None = None,
        prompt: int | None = None,
        kind: str | None = None,
        last: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Learn one answer of ``completion_tokens`` given by a node of ``kind``."""
        x = float(completion_tokens)
        prompt, last, prompt_tokens = self._used(prompt, last, prompt_tokens)
        whole, keys = self._keys(
            api_key, route, max_tokens, prefix, prompt, kind, last, prompt_tokens
        )
        cuts = (
            [] if prompt is None else self._prompt_keys(api_key or "", route, prompt, kind, "-cut")
        )
        cut_off = max_tokens is not None and completion_tokens >= max_tokens
        if cut_off:  # a bound, not a length of its question
            keys = [k for k in keys if "#last" not in k[1]]
        if cuts and cut_off:
            keys = keys[whole:]  # cut at its cap: not its own length, only a bound on it
            for cut in cuts:
                prev_cut = self._stats.pop(cut, None)
                self._stats[cut] = (max(x, prev_cut[0]) if prev_cut else x, 1)
        else:
            for cut in cuts:  # it ended on its own: an earlier cut bounds it no more
                self._stats.pop(cut, None)
        v = self._to_stat(x)
        for k in keys:
            prev = self._stats.pop(k, None)
            if prev is None:
                self._stats[k] = (v, 1)
            else:
                self._stats[k] = (prev[0] + self.knobs.alpha * (v - prev[0]), prev[1] + 1)
        self._trim()

    def __len__(self) -> int:
        return len(self._stats)
