"""The gateway's tokenizers, fetched from the nodes that serve each model.

Invariants: the gateway holds no model files of its own. A model's tokenizer and chat template
come from ``GET /tokenizer/{model}`` on a node that serves it, are written under
``<home>/tokenizers/<identity>/`` and reused by identity: a node serving a changed model (new
identity) is fetched anew; concurrent first requests share one fetch.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx

from gateway.front.node_client import NodeClient
from routing.fleet.state import NodeState
from routing.model_store import home_dir
from routing.prompt import TOKENIZER_FILES, PromptFormatter

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


class TokenizerUnavailable(LookupError):
    pass


class AddedTokenSplits:
    """Where ``tokenizers`` cuts a text on the tokenizer's added tokens, and a cache of the token
    ids of prompt prefixes that end at such a cut.

    ``tokenizers`` first splits a text on its added tokens (special ones like ``<|im_start|>``
    included), each match leftmost-longest, and then normalizes, pre-tokenizes and runs the
    model on each piece between them on its own. So for a cut at the end of an added token,
    ``encode(text) == encode(text[:cut]) + encode(text[cut:])``, provided nothing looks across
    pieces: no normalizer, pre-tokenizers that work piece by piece (not Metaspace, whose
    ``prepend_scheme: first`` depends on a piece's position), no truncation or padding, no
    added token with ``lstrip``/``rstrip``/``single_word``, added tokens all matched in one
    pass (all ``normalized`` or none), special tokens split (``encode_special_tokens`` off).
    :meth:`create` checks all of that, and then that the identity holds on sample chats,
    and returns None when anything does not fit (the formatter then encodes whole texts).

    The cache maps a prefix (the text before a chat's last message: the system prompt and the
    earlier turns, which repeat from request to request) and a suffix (what the template adds
    after the last message: the generation prompt) to their token ids; the last message is
    always tokenized anew. LRU-bounded in entries and tokens; thread-safe (long prompts are
    tokenized in worker threads).
    """

    _SAFE_PRE_TOKENIZERS = frozenset(
        {
            "ByteLevel",
            "Digits",
            "Split",
            "Punctuation",
            "Whitespace",
            "WhitespaceSplit",
            "UnicodeScripts",
            "CharDelimiterSplit",
            "BertPreTokenizer",
        }
    )

    def __init__(
        self, pattern: re.Pattern[str], max_entries: int = 512, max_tokens: int = 1 << 18
    ) -> None:
        self.pattern = pattern
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def create(cls, fmt: PromptFormatter) -> AddedTokenSplits | None:
        tok = fmt.tokenizer
        try:
            spec = json.loads(tok.to_str())
        except (ValueError, TypeError):
            return None
        if spec.get("normalizer") is not None or tok.truncation or tok.padding:
            return None
        if getattr(tok, "encode_special_tokens", False):
            return None
        if not cls._pieces_alone(spec.get("pre_tokenizer")):
            return None
        added = list(tok.get_added_tokens_decoder().values())
        contents = [t.content for t in added]
        if (
            not added
            or any(t.lstrip or t.rstrip or t.single_word or not t.content for t in added)
            or len({t.normalized for t in added}) != 1
            or len(set(contents)) != len(contents)
        ):
            return None
        longest_first = sorted(contents, key=len, reverse=True)
        splits = cls(re.compile("|".join(re.escape(c) for c in longest_first)))
        return splits if splits._holds_on_samples(fmt) else None

    @classmethod
    def _pieces_alone(cls, pre: Any) -> bool:
        if pre is None:
            return True
        if not isinstance(pre, dict):
            return False
        if pre.get("type") == "Sequence":
            return all(cls._pieces_alone(p) for p in pre.get("pretokenizers") or ())
        return pre.get("type") in cls._SAFE_PRE_TOKENIZERS

    def _holds_on_samples(self, fmt: PromptFormatter) -> bool:
        chats = [
            [{"role": "user", "content": "Hi there! What is 12 + 30?"}],
            [
                {"role": "system", "content": " You are terse.\n\n  Answer in 3 words. "},
                {"role": "user", "content": "  Where is Zürich?\t(1 line)  "},
                {"role": "assistant", "content": "In Switzerland, 🇨🇭."},
                {"role": "user", "content": "And 2024's population?"},
            ],
        ]
        try:
            for chat in chats:
                text = fmt.render(chat)
                last = chat[-1]["content"]
                at = text.rfind(last)
                cut, end, _ = self.cuts(text, at, at + len(last))
                if cut <= 0 or end >= len(text):
                    return False
                pieces = fmt.encode(text[:cut]) + fmt.encode(text[cut:end]) + fmt.encode(text[end:])
                if fmt.encode(text) != pieces:
                    return False
        except Exception:  # any template or tokenizer trouble: do not use the cache
            return False
        return True

    def cuts(self, text: str, start: int, end: int) -> tuple[int, int, bool]:
        """Cuts around ``text[start:end]``: the end of the last added token of ``text`` that
        ends at or before ``start`` (0 if none), the start of the first one that starts at
        or after ``end`` (``len(text)`` if none), and whether no added token lies between."""
        cut, clean = 0, True
        for m in self.pattern.finditer(text):
            if m.end() <= start:
                cut = m.end()
            elif m.start() >= end:
                return cut, m.start(), clean
            else:
                clean = False
        return cut, len(text), clean

    def get(self, prefix: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get(prefix)
            if ids is None:
                self.misses += 1
                return None
            self._ids.move_to_end(prefix)
            self.hits += 1
        return ids.tolist()

    def put(self, prefix: str, ids: list[int]) -> None:
        if len(ids) > self.max_tokens // 4:
            return
        arr = array("I", ids)
        with self._lock:
            old = self._ids.pop(prefix, None)
            if old is not None:
                self._tokens -= len(old)
            self._ids[prefix] = arr
            self._tokens += len(arr)
            while len(self._ids) > self.max_entries or self._tokens > self.max_tokens:
                _, dropped = self._ids.popitem(last=False)
                self._tokens -= len(dropped)


class WordCache:
    """Token ids of pre-tokens ("words"), for short ASCII text and the common byte-level BPE.

    With no normalizer, a BPE model without dropout, and a pre-tokenizer that is ByteLevel
    (``add_prefix_space`` off, the GPT-2 regex) alone or after ``Digits(individual_digits)``,
    ``tokenizers`` encodes a text with no added token in it by splitting it into pre-tokens and
    running the model on each on its own. On ASCII text the GPT-2 regex's Unicode classes are
    plain ASCII ones, so Python's ``re`` splits it as the tokenizer does, and a pre-token
    encoded alone gets the ids it gets inside the text: the ids of a text are its words' ids,
    one after the other. Words repeat far more than texts do, so their ids are cached; a word
    seen for the first time is encoded by the tokenizer itself. :meth:`create` checks the
    set-up and then the identity on sample texts, and returns None when anything does not fit.

    Used for texts up to ``MAX_CHARS`` (longer ones are encoded whole, off the event loop and
    without holding the GIL) with at most ``MAX_MISSES`` new words (else the text is encoded
    whole). At most ``MAX_WORDS`` words are kept (then the cache starts over).
    """

    GPT2_ASCII = re.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+", re.ASCII
    )
    DIGIT = re.compile(r"([0-9])")
    MAX_CHARS = 2000
    MAX_MISSES = 16
    MAX_WORDS = 50_000

    def __init__(self, encode: Callable[[str], list[int]], digits: bool) -> None:
        self._encode = encode
        self.digits = digits
        self._ids: dict[str, list[int]] = {}

    @classmethod
    def create(cls, fmt: PromptFormatter) -> WordCache | None:
        try:
            spec = json.loads(fmt.tokenizer.to_str())
        except (ValueError, TypeError):
            return None
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout") or spec.get("normalizer"):
            return None
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
        digits = False
        if len(steps or ()) == 2 and steps[0] == {"type": "Digits", "individual_digits": True}:
            digits, steps = True, steps[1:]
        if len(steps or ()) != 1:
            return None
        bl = steps[0]
        if bl.get("type") != "ByteLevel" or bl.get("add_prefix_space") or not bl.get("use_regex"):
            return None
        words = cls(fmt.encode, digits)
        samples = [
            "Hi there! In 1 sentence, what's 12+30? It's 42 -- isn't it?",
            "  Leading and trailing  \n\n spaces,\ttabs\r\n and\x0b\x0c odd\x1f bytes~  ",
            "they'll we've I'm you'd she's 'quoted' ''s x'S A1B2c3 3.14159 ...!!! (a)[b]{c}",
        ]
        for text in samples:
            expected = fmt.encode(text)
            if words.encode(text, len(text)) != expected or words.encode(text) != expected:
                return None
        return words

    def split(self, text: str) -> list[str]:
        """The pre-tokens of an ASCII text."""
        if not self.digits:
            return self.GPT2_ASCII.findall(text)
        out: list[str] = []
        for i, piece in enumerate(self.DIGIT.split(text)):
            if i % 2:
                out.append(piece)
            elif piece:
                out += self.GPT2_ASCII.findall(piece)
        return out

    def encode(self, text: str, max_misses: int = MAX_MISSES) -> list[int] | None:
        """The ids of ``text`` (no added token in it), or None when it is not for this cache
        (not ASCII, too long, or more than ``max_misses`` words not in the cache)."""
        if len(text) > self.MAX_CHARS or not text.isascii():
            return None
        words = self.split(text)
        cache = self._ids
        found = [cache.get(w) for w in words]
        misses = found.count(None)
        if misses:
            if misses > max_misses:
                return None
            if len(cache) + misses > self.MAX_WORDS:
                cache.clear()
            for i, w in enumerate(words):
                if found[i] is None:
                    ids = cache.get(w)
                    if ids is None:
                        ids = cache[w] = self._encode(w)
                    found[i] = ids
        out: list[int] = []
        for ids in found:
            out += ids  # type: ignore[arg-type]
        return out


class GatewayFormatter(PromptFormatter):
    """The model's formatter, tokenizing through the batch entry point of ``tokenizers``.

    Same token ids as ``PromptFormatter.encode``, but the batch call releases the GIL while
    the Rust code runs (the single-text ``encode`` holds it), so a long prompt tokenized in a
    worker thread does not stall the event loop; it also skips computing offsets, which the
    gateway never reads, and so costs less for short prompts too.

    ``encode_chat`` gives the same ids as ``PromptFormatter.encode_chat`` too, tokenizing only
    the chat's last message (from the added token before it) when the ids of everything before
    are cached (see :class:`AddedTokenSplits`).
    """

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return batch([text], add_special_tokens=False)[0].ids

    @cached_property
    def splits(self) -> AddedTokenSplits | None:
        return AddedTokenSplits.create(self)

    @cached_property
    def words(self) -> WordCache | None:
        return WordCache.create(self) if self.splits is not None else None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        text = self.render(messages, add_generation_prompt=True, **extra)
        splits = self.splits
        if splits is not None and messages:
            last = messages[-1].get("content")
            at = text.rfind(last) if isinstance(last, str) and last else -1
            if at < 0 and isinstance(last, str):  # templates often trim the content
                last = last.strip()
                at = text.rfind(last) if last else -1
            if at > 0:
                cut, end, clean = splits.cuts(text, at, at + len(last))
                if cut > 0:
                    middle = text[cut:end]
                    words = self.words if clean else None
                    ids = words.encode(middle) if words is not None else None
                    return (
                        self._cached(splits, text[:cut])
                        + (ids if ids is not None else self.encode(middle))
                        + (self._cached(splits, text[end:]) if end < len(text) else [])
                    )
        return self.encode(text)

    def _cached(self, splits: AddedTokenSplits, text: str) -> list[int]:
        ids = splits.get(text)
        if ids is None:
            ids = self.encode(text)
            splits.put(text, ids)
        return ids


class TokenizerCache:
    def __init__(self, client: NodeClient, root: Path | None = None) -> None:
        self.client = client
        self.root = root or home_dir() / "tokenizers"
        self._by_identity: dict[str, PromptFormatter] = {}
        self._pending: dict[str, asyncio.Future[PromptFormatter]] = {}

    def cached(self, identity: str) -> PromptFormatter | None:
        return self._by_identity.get(identity)

    async def get(self, model: str, identity: str, nodes: Iterable[NodeState]) -> PromptFormatter:
        hit = self._by_identity.get(identity)
        if hit is not None:
            return hit
        if not _SAFE.match(identity):
            raise TokenizerUnavailable(f"unsafe model identity {identity!r}")
        folder = self.root / identity
        if (folder / "tokenizer.json").is_file():
            fmt = GatewayFormatter.from_folder(folder)
            self._by_identity[identity] = fmt
            return fmt
        pending = self._pending.get(identity)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[PromptFormatter] = asyncio.get_running_loop().create_future()
        self._pending[identity] = fut
        try:
            fmt = await self._fetch(model, identity, list(nodes), folder)
            self._by_identity[identity] = fmt
            fut.set_result(fmt)
            return fmt
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._pending.pop(identity, None)

    async def _fetch(
        self, model: str, identity: str, nodes: list[NodeState], folder: Path
    ) -> PromptFormatter:
        errors = []
        for node in nodes:
            if node.model_identities.get(model, identity) != identity:
                continue
            try:
                resp = await self.client.get(
                    f"{node.url.rstrip('/')}/tokenizer/{model}", timeout=10.0
                )
                resp.raise_for_status()
                data = resp.json()
                if data.get("identity") != identity:
                    errors.append(f"{node.id}: serves identity {data.get('identity')}")
                    continue
                files = {k: v for k, v in data["files"].items() if k in TOKENIZER_FILES}
                if "tokenizer.json" not in files:
                    errors.append(f"{node.id}: no tokenizer.json")
                    continue
                return self._store(folder, files)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                errors.append(f"{node.id}: {exc}")
        raise TokenizerUnavailable(
            f"no node could give the tokenizer of {model!r}: {'; '.join(errors) or 'no nodes'}"
        )

    def _store(self, folder: Path, files: dict[str, str]) -> PromptFormatter:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
        for name, text in files.items():
            (tmp / name).write_text(text)
        fmt = GatewayFormatter.from_folder(tmp)  # verify before publishing
        try:
            os.replace(tmp, folder)
        except OSError:  # another process published it first: use theirs
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        return GatewayFormatter.from_folder(folder) if folder.is_dir() else fmt
