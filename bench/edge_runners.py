"""The edge decode benchmark's in-process runners: our EdgeEngine and onnxruntime-genai.

Each offers the same measurements: ``single`` (decode tok/s of one stream after its first
token, and the tokens), ``concurrent`` (steady-state tok/s of 4 streams), ``prefill_s`` (time to
the first token of one prompt), ``close``; and ``load_s``, ``kv_mb``, ``huge_pages_mb``.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
]
LONG_TEXT = (
    "Edge nodes answer short requests close to the user, while a cloud engine with continuous "
    "batching serves the long ones. The router predicts the time to first token and the total "
    "latency of every eligible node from measured rates, and picks the node that finishes first. "
)


# --- prompts -------------------------------------------------------------------------------------


def prompt_ids(model_dir: Path, prefill_tokens: int) -> tuple[list[list[int]], list[int]]:
    from routing.prompt import PromptFormatter

    fmt = PromptFormatter.from_folder(model_dir)
    chats = [fmt.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    text = LONG_TEXT * (prefill_tokens // 40 + 2)
    long_ids = fmt.encode_chat([{"role": "user", "content": "Summarize: " + text}])
    return chats, long_ids[-prefill_tokens:]


# --- runners: one engine each, the same measurements ---------------------------------------------


class OursRunner:
    """EdgeEngine (default config: 4 slots) driven through its async API.

    ``huge_pages=False`` leaves the session's memory in the pages it got (the ablation of
    ``edge_runtime.huge_pages``)."""

    def __init__(
        self,
        folder: Path,
        threads: int,
        huge_pages: bool = True,
    ) -> None:
        from edge_runtime.engine import EdgeEngine, EdgeEngineConfig

        self.loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        # cold prompts, as the peers run them (a repeated prompt would reuse its cached KV)
        config = EdgeEngineConfig(
            slots=4, threads=threads, huge_pages=huge_pages, prefix_reuse=False
        )
        self.engine = EdgeEngine(folder, config)
        self.loop.run_until_complete(self.engine.start())
        self.load_s = time.perf_counter() - t0
        self.kv_mb = self.engine.kv_bytes / 1e6
        self.huge_pages_mb = self.engine.huge_pages.collapsed_mb

    async def _one(self, ids: list[int], new: int) -> tuple[list[int], list[float]]:
        from routing.engine import GenerationRequest, SamplingParams

        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        stamps: list[float] = []
        async for ev in self.engine.generate(GenerationRequest(ids, params)):
            tokens += ev.token_ids
            stamps += [time.perf_counter()] * len(ev.token_ids)
        return tokens, stamps

    def single(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        """Decode tokens/s after the first token, and the tokens."""
        tokens, stamps = self.loop.run_until_complete(self._one(ids, new))
        return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens

    def concurrent(self, ids: list[int], new: int, streams: int = 4) -> float:
        """Steady state: tokens after every stream has its first, over that time."""

        async def run() -> list[tuple[list[int], list[float]]]:
            return await asyncio.gather(*(self._one(ids, new) for _ in range(streams)))

        runs = self.loop.run_until_complete(run())
        start = max(stamps[0] for _, stamps in runs)
        end = max(stamps[-1] for _, stamps in runs)
        return sum(sum(1 for t in stamps if t > start) for _, stamps in runs) / (end - start)

    def prefill_s(self, ids: list[int]) -> float:
        t = time.perf_counter()
        self.loop.run_until_complete(self._one(ids, 1))
        return time.perf_counter() - t

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


class GenaiRunner:
    """onnxruntime-genai's Generator, greedy, with the same thread count."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        t0 = time.perf_counter()
        config = og.Config(str(folder))
        overlay = {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)
        self.load_s = time.perf_counter() - t0
        self.kv_mb = 0.0  # sized per request (max_length) by onnxruntime-genai
        self.huge_pages_mb = 0.0

    def _generator(self, batch: int, length: int) -> Any:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(
            batch_size=batch, max_length=length, min_length=length, do_sample=False
        )
        return self.og.Generator(self.model, params)

    def single(self, ids: list[int], new: int) -> tuple[float, list[int]]:
        gen = self._generator(1, len(ids) + new)
        gen.append_tokens(np.array([ids], np.int32))  # runs the prompt
        stamps, tokens = [], []
        while not gen.is_done():
            gen.generate_next_token()
            stamps.append(time.perf_counter())
            tokens.append(int(gen.get_next_tokens()[0]))
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), tokens

    def concurrent(self, ids: list[int], new: int, streams: int = 4) -> float:
        gen = self._generator(streams, len(ids) + new)
        gen.append_tokens(np.array([ids] * streams, np.int32))
        gen.generate_next_token()  # the first token of every stream
        t = time.perf_counter()
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        return streams * steps / (time.perf_counter() - t)

    def prefill_s(self, ids: list[int]) -> float:
        gen = self._generator(1, len(ids) + 1)
        t = time.perf_counter()
        gen.append_tokens(np.array([ids], np.int32))
        gen.generate_next_token()
        return time.perf_counter() - t

    def close(self) -> None:
        pass


def peak_rss_mb() -> float:
    """This process's peak RSS. /proc's VmHWM, not getrusage: Linux carries the parent's
    high-water mark across fork+exec into ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
