"""The edge's quality gate: its scoring rules, its cache, and on the default model, on this
machine's CPU, that the variant it picks answers right and alike however the edge serves it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from edge_runtime.engine import EdgeEngine, EdgeEngineConfig, greedy
from edge_runtime.export import VARIANTS, ensure_export
from edge_runtime.quality_gate import (
    GATE_FILE,
    NLL_TOLERANCE,
    GateResult,
    QualitySet,
    _Evaluation,
    answers_right,
    choose_variant,
    cpu_signature,
    read_gate,
    run_gate,
)
from routing.engine import GenerationRequest
from routing.model_store import resolve
from routing.prompt import PromptFormatter


def test_answers_match_whole_words() -> None:
    assert answers_right("The capital of Italy is Rome.", ["rome"])
    assert not answers_right("Il capo di Italy.", ["rome"])
    assert answers_right("3 + 5 = 8", ["8", "eight"])
    assert not answers_right("3 + 5 = 18", ["8", "eight"])  # a digit inside a number
    assert not answers_right("Romeo", ["rome"])


def test_shipped_set_is_usable() -> None:
    qset = QualitySet.shipped()
    assert len(qset.references) >= 20 and len(qset.questions) >= 20
    assert all(p and a for p, a in qset.references)
    assert all(p and accept for p, accept in qset.questions)
    assert len(qset.digest) == 16


def test_scoring_rules() -> None:
    base = _Evaluation(invariant=True, correct=18, total=23, nll=1.7)
    ok = _Evaluation(invariant=True, correct=17, total=23, nll=1.7 * (1 + NLL_TOLERANCE) - 1e-6)
    assert ok.scored("int8", 20.0, base).passed
    worse = _Evaluation(invariant=True, correct=16, total=23)  # stopped before its NLL
    score = worse.scored("int8", 20.0, base)
    assert not score.passed and score.why == "16/23 questions, fp32 18"
    drift = _Evaluation(invariant=True, correct=18, total=23, nll=1.7 * 1.04)
    assert drift.scored("int4", 10.0, base).why == "NLL +4.0% of fp32"
    moving = _Evaluation(invariant=False, correct=10, total=23)
    assert moving.scored("int4", 10.0, base).why.startswith("answers change")
    assert base.scored("fp32", 50.0, None).passed  # fp32 is the baseline, never rejected


def test_gate_on_a_tiny_model_is_cached_per_cpu(tiny_model_path: Path, tmp_path: Path) -> None:
    first = choose_variant(tiny_model_path, root=tmp_path, threads=1)
    assert [s.variant for s in first.scores] == list(VARIANTS)
    chosen = first.score(first.chosen)
    assert chosen is not None and (first.chosen == "fp32" or chosen.passed)
    faster = [s for s in first.scores if s.passed and s.decode_ms < chosen.decode_ms]
    assert not faster  # the fastest variant that passed
    path = tmp_path / resolve(tiny_model_path).identity / GATE_FILE
    again = choose_variant(tiny_model_path, root=tmp_path, threads=1)
    assert again == first  # read back, not measured again
    assert read_gate(resolve(tiny_model_path), tmp_path) == first
    data = json.loads(path.read_text())
    data["cpu"] = "another CPU"
    path.write_text(json.dumps(data))
    assert read_gate(resolve(tiny_model_path), tmp_path) is None  # measured again elsewhere
    graphs = {v: ensure_export(tiny_model_path, v, root=tmp_path) for v in VARIANTS}
    rerun = run_gate(graphs, QualitySet.shipped(), threads=1)
    assert rerun.cpu == cpu_signature() and GateResult.from_json(rerun.to_json()) == rerun


async def test_default_variant_answers_alike_however_served(default_model_path: Path) -> None:
    """On this CPU the gate's variant of the default model answers the plain question right,
    and the same greedy tokens alone, again over its own cached prefix, in 16-token prefill
    chunks, and batched beside other answers."""
    gate = choose_variant(default_model_path)
    folder = ensure_export(default_model_path, gate.chosen).folder
    fmt = PromptFormatter.from_folder(folder)
    stops = fmt.stop_token_ids
    ids = fmt.encode_chat(
        [{"role": "user", "content": "What is the capital of Italy? Answer in one word."}]
    )
    others = [
        fmt.encode_chat([{"role": "user", "content": q}])
        for q in ("Name three fruits.", "What is a computer?", "Why is exercise good for you?")
    ]

    async def answer(engine: EdgeEngine, prompt: list[int]) -> list[int]:
        out: list[int] = []
        async for event in engine.generate(GenerationRequest(prompt, greedy(24, stops))):
            out += event.token_ids
        return out

    whole = EdgeEngine(folder, EdgeEngineConfig(slots=4, context=512, threads=2))
    chunked = EdgeEngine(
        folder, EdgeEngineConfig(slots=4, context=512, threads=2, prefill_chunk=16)
    )
    await whole.start()
    await chunked.start()
    try:
        alone = await answer(whole, ids)
        reused = await answer(whole, ids)  # its prefix is kept in a slot now
        assert whole.stats().prefix_hit_rate > 0
        batched = await asyncio.gather(*(answer(chunked, p) for p in [*others, ids]))
    finally:
        await whole.shutdown()
        await chunked.shutdown()
    assert "Rome" in fmt.decode(alone), (gate.chosen, fmt.decode(alone))
    assert reused == alone
    assert batched[-1] == alone
