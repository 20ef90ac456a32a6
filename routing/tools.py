"""Tool calling: a request's tools and ``tool_choice``, the chat template's inputs for them, and
the grammar that holds the model to the Hermes call format.

Both the gateway (prompt tokens for routing) and the node (the prompt it serves) render a
chat through :func:`template_inputs`, so they agree token for token. Nothing here imports torch.

Invariants:
- :func:`parse_tool_calling` accepts OpenAI's ``tools`` (function tools, unique names of at most
  64 characters from ``[A-Za-z0-9_-]``, ``parameters`` a JSON schema object), ``tool_choice``
  (``auto``, ``none``, ``required`` or ``{"type": "function", "function": {"name": ...}}`` naming
  one of them) and ``parallel_tool_calls``; anything else is :class:`InvalidTools` (HTTP 400
  naming ``param``). No tools, or ``tool_choice`` absent without tools, is None.
- The output format is Hermes' (Qwen2.5/Qwen3): each call is ``<tool_call>\\n{"name": NAME,
  "arguments": ARGS}\\n</tool_call>``, calls separated by ``\\n``, ARGS compact JSON following the
  function's schema. The grammar (:meth:`ToolCalling.grammar_spec`) enforces it: ``required`` and
  a named choice allow calls only (a named choice exactly one call of that function), ``auto``
  allows text, and once the text writes ``<tool_call>`` only calls follow; ``none`` allows text
  without ``<tool_call>``. ``parallel_tool_calls: false`` allows at most one call.
- Templates that mention ``tools`` get the tools and the history as Hugging Face's
  ``apply_chat_template(tools=...)`` passes them (tool call arguments as objects); other
  templates get the Hermes default: a ``# Tools`` section in the system turn, calls written in
  the assistant's text, ``tool`` results as a user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from routing.grammar import GrammarSpec, InvalidGrammar, canonical, tool_calls_spec

ChoiceMode = Literal["auto", "none", "required", "function"]
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class InvalidTools(InvalidGrammar):
    """Malformed ``tools`` / ``tool_choice`` / tool messages (HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str = "tools") -> None:
        super().__init__(message, param)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call; ``parameters`` is its schema as canonical JSON."""

    name: str
    description: str | None
    parameters: str
    strict: bool

    def as_openai(self) -> dict[str, Any]:
        """The tool as the request sent it (what templates iterate over)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """What a request allows: its tools, the choice among them, and parallel calls."""

    tools: tuple[FunctionTool, ...]
    mode: ChoiceMode
    named: str | None = None  # the function a named choice must call
    parallel: bool = True

    @property
    def calls_possible(self) -> bool:
        """The reply may hold calls (the node parses its text into ``tool_calls``)."""
        return self.mode != "none"

    def grammar_spec(self, content: GrammarSpec | None = None) -> GrammarSpec:
        """The grammar of the reply: calls in the Hermes format as :attr:`mode` allows, and
        where text is allowed, text (or ``content``, a response_format's JSON, in its place)."""
        tools = [t for t in self.tools if self.named is None or t.name == self.named]
        return tool_calls_spec(
            [(t.name, t.parameters, t.strict) for t in tools],
            text=self.mode in ("auto", "none"),
            calls=self.mode != "none",
            parallel=self.parallel and self.named is None,
            content=content,
        )


def parse_tool_calling(
    tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolCalling | None:
    """The request's tool calling (None: no tools); raises :class:`InvalidTools`."""
    if not tools:
        if tool_choice is None or tool_choice in ("none", "auto"):
            return None
        raise InvalidTools("tool_choice needs tools", "tool_choice")
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InvalidTools("tools must be a list of function tools")
    parsed = tuple(_function_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidTools("tool function names must be unique")
    mode, named = _choice(tool_choice, names)
    return ToolCalling(parsed, mode, named, parallel_tool_calls is not False)


def _function_tool(tool: Any, i: int) -> FunctionTool:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise InvalidTools(f'{where} must be {{"type": "function", "function": {{...}}}}')
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidTools(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidTools(f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _, -")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise InvalidTools(f"{where}.function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise InvalidTools(f"{where}.function.parameters must be a JSON schema object")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidTools(f"{where}.function.strict must be a boolean")
    return FunctionTool(name, desc, canonical(dict(params)), bool(strict))


def _choice(choice: Any, names: list[str]) -> tuple[ChoiceMode, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if name in names:
            return "function", name
        raise InvalidTools(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    raise InvalidTools(
        'tool_choice must be "auto", "none", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


# ---- the chat template's inputs ----------------------------------------------------------------


def template_has_tools(chat_template: str | None) -> bool:
    """Whether the model's own template renders ``tools`` (else the Hermes default is used)."""
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def field_of(obj: Any, name: str, default: Any = None) -> Any:
    """``obj[name]`` of a mapping, else its attribute (bodies come as dicts or pydantic)."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def calling_of(body: Any) -> ToolCalling | None:
    """The tool calling a chat body asks for (dict or pydantic); raises :class:`InvalidTools`."""
    return parse_tool_calling(
        field_of(body, "tools"),
        field_of(body, "tool_choice"),
        field_of(body, "parallel_tool_calls"),
    )


def template_inputs(
    messages: Sequence[Any], calling: ToolCalling | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables the chat template renders: as Hugging Face passes them
    where the template handles tools, else rewritten in the Hermes default. ``messages`` are
    OpenAI chat messages (dicts or pydantic; content as text or text parts)."""
    flat = [_flat_message(m, i) for i, m in enumerate(messages)]
    tools = [t.as_openai() for t in calling.tools] if calling is not None else None
    if template_has_tools(chat_template):
        return flat, ({"tools": tools} if tools else {})
    return _hermes_messages(flat, tools), {}


def _flat_message(m: Any, i: int) -> dict[str, Any]:
    role = field_of(m, "role")
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(field_of(m, "content")),
    }
    calls = field_of(m, "tool_calls")
    if calls:
        out["tool_calls"] = [_template_call(c, i, j) for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if field_of(m, key) is not None:
            out[key] = field_of(m, key)
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(field_of(p, "text", "") for p in content)


def _template_call(call: Any, i: int, j: int) -> dict[str, Any]:
    """An assistant's tool call as templates read it: ``arguments`` parsed into an object."""
    fn = field_of(call, "function")
    args = field_of(fn, "arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as exc:
        raise InvalidTools(
            f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc.msg}",
            "messages",
        ) from None
    return {
        "id": field_of(call, "id"),
        "type": "function",
        "function": {"name": field_of(fn, "name"), "arguments": parsed},
    }


def hermes_call(name: str, arguments: Any) -> str:
    """One call as the Hermes format writes it (``arguments`` an object or its JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CALL_CLOSE}'


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes default's ``# Tools`` section (the system turn ends with it)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou can call the functions below to help with the user's request. "
        f"Their signatures are inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\n"
        "To call one, answer with its name and arguments as a JSON object inside "
        "<tool_call></tool_call>:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
    )


def _hermes_messages(
    flat: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``flat`` in the Hermes default: tools in the system turn, calls and results as text."""
    out: list[dict[str, Any]] = []
    if tools:
        section = tools_system_text(tools)
        if flat and flat[0]["role"] == "system":
            out.append({"role": "system", "content": flat[0]["content"] + "\n\n" + section})
            flat = flat[1:]
        else:
            out.append({"role": "system", "content": section})
    for i, m in enumerate(flat):
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                hermes_call(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i > 0 and flat[i - 1]["role"] == "tool":  # results of one turn share its message
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out
