"""The grammar layer (routing/grammar.py) and its use in both engines: compile cache, masks,
states rebuilt from a prefix, the numpy and torch masks alike, the router's capability filter,
and, on a tiny random model made by the test, greedy parity of the grammar path with the plain
path wherever the grammar allows the plain token, on both engines, through preemption and
cancellation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from routing.engine import GenerationRequest, SamplingParams
from routing.grammar import (
    GRAMMAR_CAPABILITY,
    Grammar,
    GrammarCompiler,
    InvalidGrammar,
    allowed_bits,
    apply_bitmask,
    canonical,
    check_spec,
    fill_masks,
    json_object_spec,
    json_schema_spec,
    spec_from_response_format,
    tool_calls_spec,
)
from routing.prompt import PromptFormatter

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def fmt(default_model_path: Path) -> PromptFormatter:
    return PromptFormatter.from_folder(default_model_path)


@pytest.fixture(scope="module")
def compiler(fmt: PromptFormatter) -> GrammarCompiler:
    return GrammarCompiler(fmt.tokenizer.to_str(), VOCAB, fmt.stop_token_ids)


def _ids(fmt: PromptFormatter, text: str) -> list[int]:
    return fmt.encode(text)


def test_compiled_once_per_schema(compiler: GrammarCompiler) -> None:
    a = compiler.compile(json_schema_spec(SCHEMA))
    assert compiler.compile(json_schema_spec(json.loads(json.dumps(SCHEMA)))) is a
    assert compiler.compile(json_schema_spec(SCHEMA, strict=False)) is not a
    assert compiler.compile(json_object_spec()) is not a


def test_mask_follows_the_schema_and_allows_stops_only_at_the_end(
    fmt: PromptFormatter, compiler: GrammarCompiler
) -> None:
    g = compiler.compile(json_schema_spec(SCHEMA))
    doc = _ids(fmt, '{"name":"Ann","age":7,"pets":["cat"]}')
    state = g.start()
    for i, tok in enumerate(doc):
        bits = allowed_bits(state.mask(), VOCAB)
        assert bits[tok], f"token {i} of a valid reply refused"
        assert not any(bits[s] for s in fmt.stop_token_ids), "a stop allowed mid-reply"
        assert state.advance(tok)
    bits = allowed_bits(state.mask(), VOCAB)
    assert state.accepting and all(bits[s] for s in fmt.stop_token_ids)
    # whitespace is never allowed (replies cannot run on in spaces or newlines)
    state = g.start(doc[:1])
    bits = allowed_bits(state.mask(), VOCAB)
    assert not bits[_ids(fmt, " ")[0]] and not bits[_ids(fmt, "\n")[0]]
    # the wrong type for "age" is refused
    bad = _ids(fmt, '{"name":"Ann","age":"x')
    state = g.start()
    assert not all(state.advance(t) for t in bad)
    # a state that refused a token allows the stop tokens alone: the request ends
    assert set(np.flatnonzero(allowed_bits(state.mask(), VOCAB))) == set(fmt.stop_token_ids)


def test_a_state_rebuilt_from_a_prefix_is_the_advanced_one(
    fmt: PromptFormatter, compiler: GrammarCompiler
) -> None:
    g = compiler.compile(json_schema_spec(SCHEMA))
    doc = _ids(fmt, '{"name":"Bob","age":42}')
    for cut in range(len(doc)):
        walked = g.start()
        for t in doc[:cut]:
            walked.advance(t)
        assert np.array_equal(walked.mask(), Grammar(g, tuple(doc[:cut])).start().mask())
    with pytest.raises(InvalidGrammar):
        g.start(_ids(fmt, "hello"))


@pytest.mark.parametrize(
    "rf",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": 5, "maximum": 1, "type": "integer"}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
        {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
        {"type": "xml"},
    ],
)  # fmt: skip
def test_bad_response_formats_raise(rf: dict) -> None:
    with pytest.raises(InvalidGrammar):
        spec = spec_from_response_format(rf)
        assert spec is not None
        check_spec(spec)


def test_strict_refuses_unknown_keywords_that_lenient_ignores() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}
    with pytest.raises(InvalidGrammar):
        check_spec(json_schema_spec(schema, strict=True))
    check_spec(json_schema_spec(schema, strict=False))
    assert spec_from_response_format({"type": "text"}) is None


def test_tool_call_grammars_follow_tool_choice(
    fmt: PromptFormatter, compiler: GrammarCompiler
) -> None:
    from routing.tools import parse_tool_calling

    def tool(name: str, props: dict) -> dict:
        params = {"type": "object", "properties": props, "required": list(props)}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = [tool("f", {"x": {"type": "integer"}}), tool("g", {"city": {"type": "string"}})]
    f_call = '<tool_call>\n{"name": "f", "arguments": {"x":3}}\n</tool_call>'
    g_call = '<tool_call>\n{"name": "g", "arguments": {"city":"Paris"}}\n</tool_call>'
    replies = {
        "text": "Just text.",
        "text+call": "Sure. " + f_call,
        "call": f_call,
        "two calls": f_call + "\n" + g_call,
        "g": g_call,
        "bad args": '<tool_call>\n{"name": "f", "arguments": {"x":"3"}}\n</tool_call>',
        "unknown fn": '<tool_call>\n{"name": "h", "arguments": {"x":3}}\n</tool_call>',
        "text after call": f_call + " and more",
        "tag in text": "I write <tool_call> here.",
    }
    expected = {  # tool_choice, parallel -> replies the grammar accepts
        ("auto", True): {"text", "text+call", "call", "two calls", "g"},
        ("auto", False): {"text", "text+call", "call", "g"},
        ("none", True): {"text"},
        ("required", True): {"call", "two calls", "g"},
        ("required", False): {"call", "g"},
        ("g", True): {"g"},
    }
    for (choice, parallel), want in expected.items():
        named = {"type": "function", "function": {"name": choice}}
        calling = parse_tool_calling(tools, named if choice == "g" else choice, parallel)
        assert calling is not None
        compiled = compiler.compile(calling.grammar_spec())
        got = set()
        for key, text in replies.items():
            st = compiled.start()
            if all(st.advance(t) for t in _ids(fmt, text)) and st.accepting:
                got.add(key)
        assert got == want, (choice, parallel)


def test_numpy_and_torch_masks_agree_and_leave_plain_rows_alone(
    fmt: PromptFormatter, compiler: GrammarCompiler
) -> None:
    from cloud_engine.grammar_mask import apply_grammar_masks

    g = compiler.compile(json_schema_spec(SCHEMA))
    states = [g.start(), None, g.start(_ids(fmt, '{"name":"A'))]
    logits = torch.randn(3, VOCAB + 64)  # wider than the mask: the extra tokens are refused
    out = apply_grammar_masks(logits, states)
    assert torch.equal(out[1], logits[1])
    for row in (0, 2):
        st = states[row]
        assert st is not None
        ref = apply_bitmask(logits[row].numpy(), st.mask())
        assert np.array_equal(np.isfinite(ref), torch.isfinite(out[row]).numpy())
        assert not torch.isfinite(out[row, VOCAB:]).any()
    assert apply_grammar_masks(logits, [None, None, None]) is logits
    # many rows: filled on llguidance's threads, the same masks as one by one
    many = [g.start(_ids(fmt, '{"name":"' + "ab" * i)) for i in range(6)]
    out = np.zeros((6, many[0].words), dtype=np.int32)
    fill_masks(many, out)
    assert all(np.array_equal(out[i], s.mask()) for i, s in enumerate(many))
    # into chosen rows of a larger buffer, the other rows left alone
    wide = np.full((9, many[0].words), 7, dtype=np.int32)
    fill_masks(many, wide, rows=[8, 0, 2, 4, 6, 1])
    assert all(np.array_equal(wide[r], out[i]) for i, r in enumerate([8, 0, 2, 4, 6, 1]))
    assert (wide[[3, 5, 7]] == 7).all()


def test_router_sends_grammar_requests_only_to_capable_nodes() -> None:
    from routing.policies import NoRoute
    from tests.test_routing_policies import cloud, edge, profile, router, view

    need = frozenset({GRAMMAR_CAPABILITY})
    fleet = view(edge(capabilities=[GRAMMAR_CAPABILITY]), cloud())
    d = router().decide(profile(40, needs=need), fleet)
    assert [c.node.id for c in d.candidates()] == ["edge-eu"]
    assert len(router().decide(profile(40), fleet).candidates()) == 2
    with pytest.raises(NoRoute) as err:
        router().decide(profile(40, needs=need), view(edge(), cloud()))
    assert err.value.code == "unsupported"


# ---- engines on a tiny random model -------------------------------------------------------


async def _run(engine, prompt: list[int], sp: SamplingParams, rid: str | None = None) -> list:
    req = GenerationRequest(list(prompt), sp, **({"request_id": rid} if rid else {}))
    out: list[int] = []
    async for ev in engine.generate(req):
        out += ev.token_ids
    return out


async def _parity(engine, fmt: PromptFormatter, compiler: GrammarCompiler) -> tuple[int, int]:
    """Greedy with a JSON-schema grammar against plain greedy, step by step: where the grammar
    allows the plain token it is the token chosen, else the chosen one is allowed. Returns the
    counts of steps of each kind."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    g = compiler.compile(json_schema_spec(schema))
    prompt = fmt.encode_chat([{"role": "user", "content": "Give me a JSON object."}])
    stops = fmt.stop_token_ids
    sp = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=stops, grammar=Grammar(g))
    out = await _run(engine, prompt, sp)
    state, same, differ = g.start(), 0, 0
    for i, tok in enumerate(out):
        plain = (await _run(engine, prompt + out[:i], SamplingParams(max_tokens=1, temperature=0)))[
            0
        ]
        bits = allowed_bits(state.mask(), VOCAB)
        assert bits[tok], f"step {i}: token {tok} is not allowed by the grammar"
        if bits[plain]:
            assert tok == plain, f"step {i}: the grammar path left the allowed plain token"
            same += 1
        else:
            differ += 1
        assert state.advance(tok)
    return same, differ


@pytest.mark.parametrize("tier", ["edge", "cloud"])
async def test_greedy_grammar_path_matches_the_plain_path_where_allowed(
    tier: str, tiny_model_path: Path, fmt: PromptFormatter, compiler, edge_home, one_torch_thread
) -> None:
    from tests.nodes import tiny_cloud_engine, tiny_edge_engine

    engine = (
        tiny_edge_engine(tiny_model_path) if tier == "edge" else tiny_cloud_engine(tiny_model_path)
    )
    await engine.start()
    try:
        same, differ = await _parity(engine, fmt, compiler)
    finally:
        await engine.shutdown()
    assert differ >= 1  # the first token: "{" is not the random model's choice
    assert same >= 4  # inside the string most tokens are allowed


async def test_cloud_grammar_rows_survive_preemption_and_cancellation(
    tiny_model_path: Path, fmt: PromptFormatter, compiler, one_torch_thread
) -> None:
    """Greedy grammar rows give the same tokens alone and in a batch that a tiny KV pool forces
    to preempt; cancelling one of them leaves the others as they were."""
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine

    long_note = {"note": {"type": "string", "minLength": 200}}
    schema = {"type": "object", "properties": long_note, "required": ["note"]}
    g = Grammar(compiler.compile(json_schema_spec(schema)))
    stops = fmt.stop_token_ids
    sp = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=stops, grammar=g)
    prompts = [fmt.encode(f"Object number {i}: " + "pad " * (20 + 9 * i)) for i in range(5)]
    alone = CloudEngine.from_model(
        tiny_model_path, "cpu", config=EngineConfig(device="cpu", kv_memory_bytes=32 << 20)
    )
    await alone.start()
    try:
        want = [await _run(alone, p, sp) for p in prompts]
    finally:
        await alone.shutdown()
    # a pool of a few blocks: the batch cannot hold every row's next tokens at once
    tight = CloudEngine.from_model(
        tiny_model_path,
        "cpu",
        config=EngineConfig(
            device="cpu", kv_memory_bytes=32 << 20, max_kv_blocks=16, max_running=5
        ),
    )
    await tight.start()
    try:

        async def cancelled() -> list[int]:
            req = GenerationRequest(list(prompts[0]), sp, request_id="cancel-me")
            got: list[int] = []
            async for ev in tight.generate(req):
                got += ev.token_ids
                if len(got) >= 3:
                    break
            return got

        results = await asyncio.gather(cancelled(), *[_run(tight, p, sp) for p in prompts[1:]])
        preempted = tight.core.counters.preemptions
    finally:
        await tight.shutdown()
    assert results[0] == want[0][: len(results[0])]
    assert results[1:] == want[1:]
    assert all(len(w) == 40 for w in want)  # the schema keeps every row going
    assert preempted > 0, "the pool was meant to force preemption"


# ---- the cloud core's look-ahead steps with grammar rows ---------------------------------

SMALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _mixed_requests(
    fmt: PromptFormatter, compiler: GrammarCompiler, grammar: str = "schema"
) -> list[GenerationRequest]:
    """Six prompts: even rows plain, odd rows under the small schema (``schema``), a
    tool-call grammar whose free text the random model's greedy tokens never leave
    (``permissive``), or no grammar (``none``)."""
    permissive = tool_calls_spec(
        [("f", canonical({"type": "object"}), False)], text=True, calls=True, parallel=True
    )
    spec = permissive if grammar == "permissive" else json_schema_spec(SMALL)
    g = None if grammar == "none" else Grammar(compiler.compile(spec))
    stops = fmt.stop_token_ids
    reqs = []
    for i in range(6):
        ids = fmt.encode(f"Row {i}: " + "fill " * (3 + 5 * i))
        sp = SamplingParams(
            max_tokens=24, temperature=0, stop_token_ids=stops, grammar=g if i % 2 else None
        )
        reqs.append(GenerationRequest(ids, sp, request_id=f"m{i}"))
    return reqs


def _drive(core, reqs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r)
    while core.has_work():
        for o in core.step():
            out[o.seq.request_id] += o.new_token_ids
    return out


def _check_small_replies(fmt: PromptFormatter, out: dict[str, list[int]]) -> int:
    """The grammar rows' replies that ended before max_tokens parse and follow ``SMALL``;
    returns how many ended."""
    ended = 0
    for i in (1, 3, 5):
        toks = out[f"m{i}"]
        if len(toks) == 24:
            continue
        ended += 1
        obj = json.loads(fmt.decode(toks))
        assert set(obj) == {"name", "n"} and isinstance(obj["name"], str)
        assert len(obj["name"]) <= 8 and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
    return ended


def test_cloud_look_ahead_steps_sample_grammar_rows_after_the_step_before(
    tiny_model_path: Path, fmt: PromptFormatter, compiler: GrammarCompiler, one_torch_thread
) -> None:
    """With overlap, a decode batch with grammar rows is looked ahead too (its masks and
    sampling wait until the step before is committed): the same tokens as planned steps on
    the reference runner, for the grammar rows and the plain rows beside them."""
    from cloud_engine.model.loader import load_model
    from tests.test_cloud_core import make_core

    model = load_model(tiny_model_path)
    planned = make_core(model, "reference", overlap=False)
    want = _drive(planned, _mixed_requests(fmt, compiler))
    ahead = make_core(model, "fused", overlap=True, max_kv_blocks=200)
    launch, pending = ahead.runner.launch, []

    def counted(batch, feed=None):
        launched = launch(batch, feed)
        pending.append(launched.pending is not None)
        return launched

    ahead.runner.launch = counted  # type: ignore[method-assign]
    got = _drive(ahead, _mixed_requests(fmt, compiler))
    assert got == want
    assert sum(pending) >= 5  # look-ahead steps with grammar rows, sampled after the one before
    assert _check_small_replies(fmt, got) >= 1
    ahead.blocks.check_integrity()
    assert ahead.blocks.num_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_grammar_rows_in_graphs_and_look_ahead(
    tiny_model_path: Path, fmt: PromptFormatter, compiler: GrammarCompiler, overlap: bool
) -> None:
    """The CUDA runner (Triton kernels, CUDA graphs, fp32): a permissive grammar gives the
    plain greedy tokens; a JSON-schema grammar's replies parse and follow the schema, and the
    plain rows beside them keep their tokens."""
    import copy

    from cloud_engine.config import EngineConfig
    from cloud_engine.core import EngineCore
    from cloud_engine.model.loader import load_model

    model = load_model(tiny_model_path, device="cuda")

    def run(grammar: str) -> tuple[dict[str, list[int]], EngineCore]:
        cfg = EngineConfig(
            device="cuda", kv_memory_bytes=64 << 20, max_running=16, max_tokens_per_step=512,
            overlap=overlap, debug_checks=True,
        )  # fmt: skip
        core = EngineCore(copy.deepcopy(model), "gpu-grammar", cfg)  # its runner takes the weights
        return _drive(core, _mixed_requests(fmt, compiler, grammar)), core

    plain, _ = run("none")
    out, core = run("schema")
    assert core.runner.graphs  # type: ignore[attr-defined]
    assert (core.counters.ahead_steps > 0) == overlap
    assert all(out[f"m{i}"] == plain[f"m{i}"] for i in (0, 2, 4))
    assert _check_small_replies(fmt, out) >= 1
    assert run("permissive")[0] == plain
