"""Tool calling: the request's tools and tool_choice (routing/tools.py), the prompt rendered as
transformers renders it for templates with a tool section (tiny random Qwen3 and Llama
checkpoints made here) and in the Hermes default for templates without one, the reply parsed
into calls however it is split (routing/tool_parser.py), and a tiny Qwen3 served by the cloud
engine whose forced call is valid."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from routing.prompt import PromptFormatter
from routing.tool_parser import ArgsDelta, CallStart, ContentDelta, ToolCallParser
from routing.tools import InvalidTools, parse_tool_calling, template_inputs
from tests.tool_templates import HERMES, LLAMA31

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]

# a conversation with two parallel calls, their results, an answer and a new question
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    {"role": "assistant", "content": "18 °C in Paris; 2 + 3 = 5."},
    {"role": "user", "content": "And in Rome?"},
]


def _hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers documents them: call arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


# ---- the request's tools ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        ([{"type": "retrieval"}], None, "tools"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)  # fmt: skip
def test_malformed_tools_name_their_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidTools) as err:
        parse_tool_calling(tools, choice, None)
    assert err.value.param == param


def test_no_tools_is_plain_and_choices_parse() -> None:
    assert parse_tool_calling(None, None, None) is None
    assert parse_tool_calling([], "auto", None) is None
    named = parse_tool_calling(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert named is not None and (named.mode, named.named, named.parallel) == (
        "function",
        "add",
        False,
    )
    required = parse_tool_calling(TOOLS, "required", None)
    assert required is not None and required.parallel and required.calls_possible
    none = parse_tool_calling(TOOLS, "none", None)
    assert none is not None and not none.calls_possible


# ---- the reply's calls -----------------------------------------------------------------------

CALL_W = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Pa}ris","x":{"y":1}}}\n</tool_call>'
)
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>'


@pytest.mark.parametrize(
    "text,content,calls",
    [
        ("Hello <tool world", "Hello <tool world", []),
        ("Sure. " + CALL_W + "\n" + CALL_A, "Sure. ",
         [("get_weather", '{"city":"Pa}ris","x":{"y":1}}', True), ("add", '{"a":1,"b":2}', True)]),
        (CALL_A, "", [("add", '{"a":1,"b":2}', True)]),
        ('a<tool_call>\n{"na', 'a<tool_call>\n{"na', []),  # cut before its name: text
        (CALL_A[:-5], "", [("add", '{"a":1,"b":2}', False)]),  # cut in its close tag
        (CALL_A[:47], "", [("add", '{"a":1', False)]),  # cut in its arguments
        (CALL_A[:40], CALL_A[:40], []),  # cut before its arguments: text
    ],
)  # fmt: skip
def test_calls_parse_alike_however_the_text_is_split(
    text: str, content: str, calls: list[tuple[str, str, bool]]
) -> None:
    rng = random.Random(7)
    for trial in range(60):
        parser, pieces, i = ToolCallParser(), [], 0
        while i < len(text):
            step = len(text) if trial == 0 else rng.randint(1, 6)
            pieces += parser.feed(text[i : i + step])
            i += step
        pieces += parser.finish()
        assert "".join(p.text for p in pieces if isinstance(p, ContentDelta)) == content
        assert [(c.name, c.arguments, c.complete) for c in parser.calls] == calls
        starts = [p for p in pieces if isinstance(p, CallStart)]
        assert [s.name for s in starts] == [c[0] for c in calls]
        assert len({s.id for s in starts}) == len(starts) and all(
            s.id.startswith("call_") for s in starts
        )
        for k, c in enumerate(calls):
            assert (
                "".join(p.text for p in pieces if isinstance(p, ArgsDelta) and p.index == k) == c[1]
            )


# ---- the prompt ------------------------------------------------------------------------------


def _checkpoint(root: Path, model_type: str, template: str, tokenizer_from: Path) -> Path:
    from cloud_engine.model.loader import save_random_model, tiny_config

    cfg = tiny_config(
        vocab_size=49152,
        max_position_embeddings=2048,
        eos_token_id=(2,),
        model_type=model_type,
        qk_norm=model_type == "qwen3",
    )
    folder = save_random_model(root / model_type, cfg, seed=11, tokenizer_from=tokenizer_from)
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return folder


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> dict[str, Path]:
    """Tiny random Qwen3 (Hermes tool template) and Llama (Llama 3.1 style) checkpoints."""
    root = tmp_path_factory.mktemp("tool-models")
    return {
        "qwen3": _checkpoint(root, "qwen3", HERMES, default_model_path),
        "llama": _checkpoint(root, "llama", LLAMA31, default_model_path),
    }


CONVERSATIONS = {
    "question": [{"role": "user", "content": "What is the weather in Paris?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "history": HISTORY,
}


@pytest.mark.parametrize("model", ["qwen3", "llama"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [True, False])
def test_prompt_equals_transformers_apply_chat_template(
    checkpoints: dict[str, Path], model: str, conversation: str, with_tools: bool
) -> None:
    from transformers import AutoTokenizer

    folder = checkpoints[model]
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    hf = AutoTokenizer.from_pretrained(folder)
    want = hf.apply_chat_template(
        _hf_messages(messages), tools=tools, tokenize=False, add_generation_prompt=True
    )
    fmt = PromptFormatter.from_folder(folder)
    msgs, extra = template_inputs(
        messages, parse_tool_calling(tools, None, None), fmt.chat_template
    )
    assert fmt.render(msgs, **extra) == want
    assert ("Add two integers." in want) == with_tools  # the tools were rendered


def test_templates_without_tools_get_the_hermes_default(default_model_path: Path) -> None:
    fmt = PromptFormatter.from_folder(default_model_path)
    assert "tools" not in (fmt.chat_template or "")
    msgs, extra = template_inputs(HISTORY, parse_tool_calling(TOOLS, None, None), fmt.chat_template)
    assert extra == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    system = msgs[0]["content"]
    assert system.startswith("You are terse.\n\n# Tools\n")
    assert json.dumps(WEATHER, ensure_ascii=False) in system and json.dumps(ADD) in system
    assert msgs[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    assert msgs[3]["content"] == (
        '<tool_response>\n{"temp_c": 18}\n</tool_response>\n<tool_response>\n5\n</tool_response>'
    )
    text = fmt.render(msgs, **extra)
    assert text.endswith("<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")
    # without tools, a history of calls still renders in the same format
    bare, _ = template_inputs(HISTORY, None, fmt.chat_template)
    assert bare[0] == {"role": "system", "content": "You are terse."}
    assert bare[2]["content"] == msgs[2]["content"]


# ---- a model with its own tool template, served --------------------------------------------


@pytest.fixture(scope="module")
def qwen3_gateway(checkpoints: dict[str, Path]) -> Iterator[str]:
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine
    from tests.nodes import gateway_over, serve_node

    engine = CloudEngine.from_model(
        checkpoints["qwen3"], "cpu", config=EngineConfig(device="cpu", kv_memory_bytes=16 << 20)
    )
    node = serve_node(engine, checkpoints["qwen3"], "cloud-tools-qwen3")
    gw = gateway_over(node.url)
    try:
        yield gw.url
    finally:
        gw.stop()
        node.stop()


def test_a_forced_call_of_a_random_qwen3_is_valid(
    qwen3_gateway: str, checkpoints: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    model = httpx.get(qwen3_gateway + "/v1/models").json()["data"][0]["id"]
    client = openai.OpenAI(base_url=qwen3_gateway + "/v1", api_key="unused", max_retries=0)
    messages = CONVERSATIONS["question"]
    done = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=64,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    # the node rendered the model's own template with the tools, as transformers does
    hf = AutoTokenizer.from_pretrained(checkpoints["qwen3"])
    rendered = hf.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    fmt = PromptFormatter.from_folder(checkpoints["qwen3"])
    assert done.usage is not None and done.usage.prompt_tokens == len(fmt.encode(rendered))
