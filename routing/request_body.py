"""Reading an OpenAI chat or completion body (a dict or a pydantic model, read alike): its
prompt's token ids, rendered and tokenized exactly as the node does (``template_messages``
flattening, no BOS of our own), its max_tokens, its ``n``, the capabilities it needs and a key
for its last message. Whatever the body holds, a bad one raises :class:`ProfileError` (a
``ValueError``) or :class:`routing.prompt.TemplateError`, nothing else: token ids outside
``[0, MAX_TOKEN_ID]``, text with lone surrogates, a max_tokens that is not an integer in
``[1, MAX_TOKENS]`` (the gateway's schema refuses them first, with the field's name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from routing.choices import MAX_CHOICES
from routing.fleet.state import Capability
from routing.prompt import PromptFormatter, UnencodableText
from routing.tools import InvalidTools, calling_of, template_inputs

Route = Literal["chat", "completions"]

MAX_TOKEN_ID = 2**31 - 1  # block hashing packs ids in 32 bits; vocabularies are far smaller
MAX_TOKENS = 2**31 - 1  # max_tokens / max_completion_tokens


class ProfileError(ValueError):
    """The request cannot be profiled (no prompt, more than one prompt, bad token ids)."""


def body_field(body: Any, name: str, default: Any = None) -> Any:
    """Field ``name`` of a body that is a mapping or a pydantic model."""
    if type(body) is dict or isinstance(body, Mapping):  # a plain dict: skip the ABC check
        return body.get(name, default)
    return getattr(body, name, default)


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        parts.append(p.get("text", "") if isinstance(p, Mapping) else getattr(p, "text", ""))
    return "".join(parts)


def chat_prompt(
    body: Any, formatter: PromptFormatter
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A chat body's messages and template variables (its tools), as the node renders them."""
    messages = body_field(body, "messages") or []
    if not messages:
        raise ProfileError("messages must not be empty")
    try:
        return template_inputs(messages, calling_of(body), formatter.chat_template)
    except InvalidTools as exc:
        raise ProfileError(str(exc)) from exc


def prompt_token_ids(body: Any, formatter: PromptFormatter, route: Route) -> list[int]:
    """The prompt's token ids, as the node will compute them."""
    try:
        if route == "chat":
            messages, extra = chat_prompt(body, formatter)
            return formatter.encode_chat(messages, **extra)
        prompt = body_field(body, "prompt")
        if isinstance(prompt, str):
            ids = formatter.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
            if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
                raise ProfileError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            ids = formatter.encode(prompt[0])
        elif (
            isinstance(prompt, list)
            and len(prompt) == 1
            and isinstance(prompt[0], list)
            and prompt[0]
            and all(type(t) is int for t in prompt[0])
        ):  # one prompt of token ids in a batch of one (evaluation harnesses send these)
            ids = list(prompt[0])
            if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
                raise ProfileError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        else:
            raise ProfileError("prompt must be a string, one string in a list, or token ids")
    except UnencodableText as exc:
        raise ProfileError(str(exc)) from exc
    if not ids:
        raise ProfileError("prompt is empty after tokenization")
    return ids


def requested_max_tokens(body: Any) -> int | None:
    """``max_completion_tokens``, else ``max_tokens`` (as the node reads them), else None."""
    value = body_field(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if value is None:
        value, name = body_field(body, "max_tokens"), "max_tokens"
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_TOKENS:
        raise ProfileError(f"{name} must be an integer in [1, {MAX_TOKENS}]")
    return value


def requested_choices(body: Any) -> int:
    """Its ``n`` when an integer in ``[1, MAX_CHOICES]``, else 1."""
    n = body_field(body, "n", 1)
    return n if type(n) is int and 1 <= n <= MAX_CHOICES else 1


def needed_capabilities(body: Any, route: Route) -> frozenset[str]:
    """What a node must list in ``NodeState.capabilities`` to serve ``body``: a grammar
    (``response_format`` json_object or json_schema, or chat ``tools``), logprobs (chat ``logprobs: true``,
    completions ``logprobs`` set), and prompt logprobs (completions with ``echo`` too)."""
    needs: set[str] = set()
    rf = body_field(body, "response_format", None)
    kind = rf.get("type") if isinstance(rf, Mapping) else None
    if kind in ("json_object", "json_schema") or (route == "chat" and body_field(body, "tools")):
        needs.add(Capability.GRAMMAR)
    if route == "chat":
        if body_field(body, "logprobs"):
            needs.add(Capability.LOGPROBS)
    elif body_field(body, "logprobs") is not None:
        needs.add(Capability.LOGPROBS)
        if body_field(body, "echo"):
            needs.add(Capability.PROMPT_LOGPROBS)
    return frozenset(needs)


def last_message_key(body: Any) -> int | None:
    """A key for a chat's last message: its role and text (None: no messages). Hashed in
    this process only, as :func:`routing.profile.prompt_key` is: output statistics are the gateway's own."""
    messages = body_field(body, "messages") or []
    if not messages:
        return None
    last = messages[-1]
    return hash((body_field(last, "role"), _message_text(body_field(last, "content"))))
