"""Rank entry points for the parallel tests (spawned processes import this module by name)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from routing.engine import GenerationRequest, SamplingParams
from routing.grammar import GrammarSpec


@dataclass(frozen=True)
class Job:
    folder: str
    tp: int
    pp: int
    requests: list[GenerationRequest]
    arrivals: list[int]
    config: EngineConfig = field(default_factory=EngineConfig)
    abandon_after: int | None = None  # stop the world after this many steps, batches in flight
    grammar: GrammarSpec | None = None  # every other request follows it (compiled by the driver)


def with_grammar(
    folder: str, reqs: list[GenerationRequest], spec: GrammarSpec
) -> list[GenerationRequest]:
    """``reqs`` with every other one following ``spec``, compiled for ``folder``'s tokenizer
    at its model's vocabulary."""
    import json
    from pathlib import Path

    from routing.grammar import Grammar, GrammarCompiler
    from routing.prompt import PromptFormatter

    fmt = PromptFormatter.from_folder(folder)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    compiled = GrammarCompiler(fmt.tokenizer.to_str(), vocab, fmt.stop_token_ids).compile(spec)
    return [
        replace(r, sampling=replace(r.sampling, grammar=Grammar(compiled))) if i % 2 == 0 else r
        for i, r in enumerate(reqs)
    ]


def drive(
    core: EngineCore,
    reqs: list[GenerationRequest],
    arrivals: list[int] | None = None,
    after_step: Callable[[EngineCore], None] | None = None,
) -> dict[str, list[int]]:
    """Submit each request at its arrival step; step until everything finished."""
    arrivals = arrivals or [0] * len(reqs)
    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    step = k = 0
    while k < len(order) or core.has_work():
        while k < len(order) and arrivals[order[k]] <= step:
            core.add(reqs[order[k]])
            k += 1
        for o in core.step():
            out[o.seq.request_id] += o.new_token_ids
        if after_step is not None:
            after_step(core)
        step += 1
        assert step < 20_000
    return out


def mixed_requests(n: int, vocab: int, seed: int = 0) -> tuple[list[GenerationRequest], list[int]]:
    """``n`` requests: several share a 40-token prefix (prefix hits for the later arrivals),
    lengths from 3 to 150 tokens, mostly greedy plus rows that go through the logits path
    (temperature 1 with a tiny top-p: deterministic argmax)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    reqs, arrivals = [], []
    for i in range(n):
        if i % 3 == 0:
            prompt = shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 150))]
        sp = (
            SamplingParams(max_tokens=rng.randint(4, 24), temperature=1.0, top_p=1e-6)
            if i % 5 == 4
            else SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0)
        )
        reqs.append(GenerationRequest(prompt, sp, request_id=f"r{i}"))
        arrivals.append(0 if i < 6 else rng.randint(1, 30))
    return reqs, arrivals


def jobs_rank(rank_idx: int, world: int, init: str, jobs: list[Job]) -> list[dict[str, Any]]:
    from cloud_engine.parallel.build import driver_core, run_worker
    from cloud_engine.parallel.dist import ParallelConfig, close_world, init_world

    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    try:
        for job in jobs:
            rank = init_world(
                ParallelConfig(job.tp, job.pp),
                rank_idx,
                init_method=init,
                device=job.config.device,
                timeout_s=60,
            )
            if rank.is_driver:
                core = driver_core(job.folder, "parity", rank, job.config)
                if job.abandon_after is not None:
                    for r in job.requests:
                        core.add(r)
                    for _ in range(job.abandon_after):
                        core.step()
                    in_flight = getattr(core, "in_flight", 0)
                    core.drain()  # type: ignore[attr-defined]
                    stats = core.runner.stop()  # type: ignore[attr-defined]
                    results.append(dict(in_flight_at_stop=in_flight, stats=stats))
                    continue
                reqs = job.requests
                if job.grammar is not None:
                    reqs = with_grammar(job.folder, reqs, job.grammar)
                tokens = drive(core, reqs, job.arrivals)
                c = core.counters
                stats = core.runner.stop()  # type: ignore[attr-defined]
                results.append(
                    dict(
                        tokens=tokens,
                        preemptions=c.preemptions,
                        cached=c.cached_prompt_tokens,
                        stats=stats,
                        blocks=core.blocks.num_blocks,
                        in_flight=getattr(core, "max_in_flight", 1),
                        executor=type(core.runner.exec).__name__,  # type: ignore[attr-defined]
                        graphs=len(getattr(core.runner.exec, "graphs", {})),  # type: ignore[attr-defined]
                    )
                )
            else:
                run_worker(job.folder, rank, job.config)
    finally:
        close_world()
    return results
