"""Constrained decoding: a request's grammar, compiled once per schema by llguidance, and its
per-request state, which gives each step's token bitmask and advances with each sampled token.

Both engines use this module: the edge applies :meth:`GrammarState.apply` (numpy) to the
logits ORT returns; the cloud engine copies :meth:`GrammarState.fill` rows to the logits'
device (``cloud_engine.grammar_mask``). Nothing here imports torch.

Invariants:
- A :class:`GrammarSpec` is what a request asked for (JSON object, JSON schema, or tool calls:
  text and Hermes calls whose arguments follow each function's schema), hashable and
  free of library objects; :func:`check_spec` turns every schema llguidance cannot compile
  into :class:`InvalidGrammar` (HTTP 400) without a tokenizer, so the gateway refuses it
  before any tokenizing or routing.
- JSON is compact: no whitespace between tokens (``whitespace_flexible: false``), so a reply
  cannot run on in spaces or newlines; strings, arrays and numbers are bounded only by the
  schema and ``max_tokens``.
- A :class:`GrammarCompiler` (one per tokenizer and vocabulary width) compiles each spec once
  (LRU by :attr:`GrammarSpec.key`); a request's :class:`GrammarState` is a copy of the compiled
  matcher, advanced over the tokens already generated when it resumes elsewhere.
- A mask's bit ``t`` (word ``t // 32``, bit ``t % 32``) is set when token ``t`` is allowed;
  tokens past the mask's width are never allowed. The stop tokens are allowed exactly when
  the grammar accepts (the reply is complete), and they alone once a state has refused a
  token: no mask is ever empty, so sampling never sees a row of -inf only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance as llg
import numpy as np

from routing.engine import EngineError
from routing.fleet.state import Capability

GRAMMAR_CAPABILITY = Capability.GRAMMAR  # what a node lists in its capabilities to take grammars
GrammarKind = Literal["json_object", "json_schema", "tool_calls"]
_LIMITS = llg.LLParserLimits(verbose_errors=False)  # errors name no parser state


class InvalidGrammar(EngineError):
    """A grammar llguidance cannot compile, or tokens it does not accept (HTTP 400)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request asked its output to follow; ``source`` is canonical JSON."""

    kind: GrammarKind
    source: str = ""  # the schema (json_schema) or the functions and options (tool_calls)
    strict: bool = True  # a schema keyword llguidance does not implement is an error

    @property
    def key(self) -> str:
        """The cache key: a hash of kind, strictness and source."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.kind}\0{int(self.strict)}\0{self.source}".encode())
        return h.hexdigest()

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) this spec compiles to."""
        options: dict[str, Any] = {"whitespace_flexible": False, "lenient": not self.strict}
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(self.source, overrides=options)
        return _tool_calls_lark(json.loads(self.source))


def canonical(obj: Any) -> str:
    """``obj`` as compact JSON, its key order kept (a schema's property order is the order the
    reply is asked to follow): the same schema hashes alike."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_schema_spec(schema: Mapping[str, Any], strict: bool = True) -> GrammarSpec:
    return GrammarSpec("json_schema", canonical(dict(schema)), strict)


def json_object_spec() -> GrammarSpec:
    return GrammarSpec("json_object")


def tool_calls_spec(
    functions: Sequence[tuple[str, str, bool]],
    *,
    text: bool,
    calls: bool,
    parallel: bool,
    content: GrammarSpec | None = None,
) -> GrammarSpec:
    """Replies of text and Hermes calls (``routing.tools``): each function is (name, schema as
    canonical JSON, strict). ``text``: text may come first (lazy: ``<tool_call>`` ends it and
    only calls follow); ``calls``: calls are allowed (without ``text``, at least one is needed);
    ``parallel``: more than one; ``content``: a JSON spec the text must follow instead."""
    if calls and not functions:
        raise InvalidGrammar("tool calls need at least one function", "tools")
    if not calls and content is not None:
        return content
    src = {
        "functions": [{"name": n, "schema": sch, "strict": st} for n, sch, st in functions],
        "text": text,
        "calls": calls,
        "parallel": parallel,
        "content": None if content is None else [content.kind, content.source, content.strict],
    }
    return GrammarSpec("tool_calls", canonical(src))


def _json_lark(schema: Any, strict: bool) -> str:
    options = {"whitespace_flexible": False, "lenient": not strict}
    obj = json.loads(schema) if isinstance(schema, str) else dict(schema)
    return f"%json {canonical({**obj, 'x-guidance': options})}"


# free text without the call opener: once the text writes it, a call must follow
_FREE_TEXT = "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/"


def _tool_calls_lark(src: Mapping[str, Any]) -> str:
    """The Lark grammar of a ``tool_calls`` spec (see :func:`tool_calls_spec`)."""
    lines = ["%llguidance {}"]
    content = src.get("content")
    if content is not None:
        kind, source, strict = content
        lines.append(
            f"content: {_json_lark(source if kind == 'json_schema' else {'type': 'object'}, strict)}"
        )
    else:
        lines.append(_FREE_TEXT)
    if not src["calls"]:
        lines.insert(1, "start: TEXT")
        return llg.LLMatcher.grammar_from_lark("\n".join(lines))
    bodies = []
    for i, fn in enumerate(src["functions"]):
        head = json.dumps(f'\n{{"name": {json.dumps(fn["name"])}, "arguments": ')
        tail = json.dumps("}\n</tool_call>")
        lines.append(f"call_{i}: {head} {_json_lark(fn['schema'], fn['strict'])} {tail}")
        bodies.append(f"call_{i}")
    lines.append(f"body: {' | '.join(bodies)}")
    more = ' ("\\n<tool_call>" body)*' if src["parallel"] else ""
    lines.append(f"calls: body{more}")
    if not src["text"]:
        start = '"<tool_call>" calls'
    elif content is not None:
        start = 'content | "<tool_call>" calls'
    else:
        lines.append('head[lazy]: TEXT "<tool_call>"')
        start = "TEXT | head calls"
    lines.insert(1, f"start: {start}")
    return llg.LLMatcher.grammar_from_lark("\n".join(lines))


@functools.lru_cache(maxsize=1024)
def _check_key(spec: GrammarSpec) -> str:
    try:
        text = spec.grammar_text()
    except (ValueError, TypeError) as exc:
        return str(exc)
    return llg.LLMatcher.validate_grammar(text)


def check_spec(spec: GrammarSpec, param: str = "response_format") -> None:
    """Raise :class:`InvalidGrammar` naming ``param`` when ``spec`` cannot compile (no
    tokenizer needed)."""
    err = _check_key(spec)
    if err:
        raise InvalidGrammar(f"invalid schema for {param}: {err}", param)


def spec_from_response_format(rf: Mapping[str, Any] | None) -> GrammarSpec | None:
    """The spec an OpenAI ``response_format`` asks for (None: plain text); raises
    :class:`InvalidGrammar` for a malformed one. The schema is not compiled here."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec()
    if kind != "json_schema":
        raise InvalidGrammar(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}"
        )
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise InvalidGrammar("response_format.json_schema must be an object")
    name = js.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidGrammar("response_format.json_schema.name must be a non-empty string")
    schema = js.get("schema", {})
    if not isinstance(schema, Mapping):
        raise InvalidGrammar("response_format.json_schema.schema must be an object")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidGrammar("response_format.json_schema.strict must be a boolean")
    return json_schema_spec(schema, strict=bool(strict))


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary width, each once (LRU by key)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``, cached; raises :class:`InvalidGrammar`."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        check_spec(spec)
        matcher = llg.LLMatcher(self.tokenizer, spec.grammar_text(), log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidGrammar(f"invalid schema for response_format: {matcher.get_error()}")
        compiled = CompiledGrammar(key, self.vocab_size, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer: the matcher every request's state copies."""

    key: str
    vocab_size: int
    matcher: llg.LLMatcher

    def start(self, prefix: Sequence[int] = ()) -> GrammarState:
        """A fresh state that has consumed ``prefix`` (tokens already generated)."""
        m = self.matcher.deep_copy()
        if prefix and not m.consume_tokens(list(prefix)):
            raise InvalidGrammar(
                f"the tokens already generated do not follow the grammar: {m.get_error()}"
            )
        return GrammarState(m, self.vocab_size)


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """What ``SamplingParams.grammar`` carries: a compiled grammar and the tokens of the
    reply generated before this request (a resumed stream), which its state consumes first."""

    compiled: CompiledGrammar
    prefix: tuple[int, ...] = ()

    def start(self) -> GrammarState:
        return self.compiled.start(self.prefix)


class GrammarState:
    """One request's position in its grammar: the next token's mask, advanced per token.
    Not thread-safe: one engine thread uses it at a time."""

    __slots__ = ("_row", "matcher", "vocab_size", "words")

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._row = np.empty(self.words, dtype=np.int32)

    def fill(self, out: np.ndarray) -> None:
        """Write the next token's bitmask into ``out`` (int32, ``words`` long, contiguous)."""
        if out.dtype != np.int32 or out.size != self.words or not out.flags["C_CONTIGUOUS"]:
            raise ValueError("the mask row must be contiguous int32 of length words")
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * 4)

    def mask(self) -> np.ndarray:
        """The next token's bitmask (a buffer reused by the next call)."""
        self.fill(self._row)
        return self._row

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the ``[vocab]`` logits row with every disallowed token at -inf."""
        return apply_bitmask(logits, self.mask())

    def advance(self, token: int) -> bool:
        """Consume the sampled ``token``; False if the grammar refused it (an error state)."""
        return bool(self.matcher.consume_token(token))

    @property
    def accepting(self) -> bool:
        """The output so far is a complete reply (a stop token may end it)."""
        return bool(self.matcher.is_accepting())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


_PARALLEL_ROWS = 4  # from this many rows on, masks are filled by llguidance's thread pool
_executor: llg.LLExecutor | None = None


def fill_masks(
    states: Sequence[GrammarState], out: np.ndarray, rows: Sequence[int] | None = None
) -> None:
    """Each state's next-token mask into a row of ``out`` (int32 ``[N, words]``, contiguous):
    state ``i`` into row ``rows[i]`` (default: row ``i``), the other rows left as they are;
    several rows at once on llguidance's threads (the GIL released)."""
    global _executor
    where = list(range(len(states))) if rows is None else list(rows)
    if (
        out.dtype != np.int32
        or out.ndim != 2
        or not out.flags["C_CONTIGUOUS"]
        or len(where) != len(states)
        or (where and not 0 <= min(where) <= max(where) < out.shape[0])
    ):
        raise ValueError("the masks must be contiguous int32 [rows, words], one row a state")
    words = out.shape[1]
    if len(states) < _PARALLEL_ROWS or any(s.words != words for s in states):
        for r, s in zip(where, states, strict=True):
            s.fill(out[r, : s.words])
        return
    if _executor is None:
        _executor = llg.LLExecutor()
    pairs = [(s.matcher, r) for r, s in zip(where, states, strict=True)]
    _executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, words * 4, out.shape[0])


def allowed_bits(bitmask: np.ndarray, width: int) -> np.ndarray:
    """The bitmask as ``width`` booleans (False past its own width)."""
    n = min(width, bitmask.size * 32)
    bits = np.unpackbits(bitmask.view(np.uint8), count=n, bitorder="little").view(np.bool_)
    if n == width:
        return bits
    return np.concatenate([bits, np.zeros(width - n, dtype=np.bool_)])


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """A copy of the ``[vocab]`` row ``logits`` with tokens the bitmask disallows at -inf."""
    return np.where(allowed_bits(bitmask, logits.shape[-1]), logits, -np.inf).astype(
        logits.dtype, copy=False
    )
