"""A model's tokenizer and chat template, loaded from its HF folder, without torch.

Invariants:
- ``render`` produces exactly what Hugging Face's ``apply_chat_template(..., tokenize=False)``
  produces for the same messages and ``tools`` (same jinja2 settings: trim_blocks,
  lstrip_blocks, sandboxed; the same ``tojson`` filter and ``strftime_now``).
- ``encode`` never adds a BOS of its own: chat templates place their own markers, and special
  tokens written in the text (``<|im_start|>``) map to their single ids.
- ``stop_token_ids`` are the ids generation ends on (generation_config's eos list, else config's).
- ``default_sampling`` holds generation_config's ``temperature``, ``top_p`` and ``top_k`` where
  it sets them: what a request that omits one gets (as vLLM does), else the API's own defaults.
- Text that cannot be tokenized (a lone surrogate) raises :class:`UnencodableText`, a
  ``ValueError``, never the tokenizer's ``TypeError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class TemplateError(ValueError):
    """The chat template rejected the messages (e.g. roles out of order)."""


class UnencodableText(ValueError):
    """Text the tokenizer cannot encode: it holds a lone surrogate (``"\\ud800"`` in JSON),
    which has no UTF-8 form. A client's mistake (HTTP 400), never a crash."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson`` filter (its arguments and defaults)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


API_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0.0}  # the API's own (top_k 0: off)
SAMPLING_FIELDS = tuple(API_SAMPLING)


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, float]:
    """The sampling fields a model's generation_config sets (numbers only)."""
    return {
        k: float(v)
        for k in SAMPLING_FIELDS
        if isinstance(v := generation_config.get(k), int | float) and not isinstance(v, bool)
    }


@dataclass
class PromptFormatter:
    """Tokenizer + chat template + stop ids of one model."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    default_sampling: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptFormatter:
        folder = Path(folder)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tcfg = _read_json(folder / "tokenizer_config.json")
        gcfg = _read_json(folder / "generation_config.json")
        mcfg = _read_json(folder / "config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        stops = _as_id_list(gcfg.get("eos_token_id")) or _as_id_list(mcfg.get("eos_token_id"))
        eos = _token_str(tcfg.get("eos_token"))
        if eos is not None and (eos_id := tokenizer.token_to_id(eos)) is not None:
            stops.append(eos_id)
        special = frozenset(
            tok.id if hasattr(tok, "id") else int(i)
            for i, tok in tokenizer.get_added_tokens_decoder().items()
            if tok.special
        )
        return cls(
            tokenizer=tokenizer,
            chat_template=template,
            bos_token=_token_str(tcfg.get("bos_token")),
            eos_token=eos,
            stop_token_ids=tuple(dict.fromkeys(stops)),
            special_token_ids=special,
            default_sampling=sampling_defaults(gcfg),
        )

    def sampling(self, name: str, value: float | None) -> float:
        """The request's ``name`` (``SAMPLING_FIELDS``) where it sets one, else this model's
        default, else the API's."""
        if value is not None:
            return value
        return self.default_sampling.get(name, API_SAMPLING[name])

    @cached_property
    def _compiled(self) -> jinja2.Template:
        if not self.chat_template:
            raise TemplateError("this model has no chat template; use /v1/completions")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render chat messages as the model's own template does."""
        try:
            return self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; :class:`UnencodableText` for text with lone surrogates."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError as exc:  # the tokenizer's answer to a str it cannot make UTF-8 of
            raise UnencodableText(_unencodable(text)) from exc

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        try:
            encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        except TypeError as exc:
            raise UnencodableText(_unencodable("".join(texts))) from exc
        return [e.ids for e in encoded]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, **extra))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _unencodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        found = exc.object[exc.start : exc.end]
        return f"text must not contain lone surrogates (U+D800 to U+DFFF), found {found!a}"
    return "text cannot be tokenized"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
