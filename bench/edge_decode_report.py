"""The edge decode benchmark's figures and report: the machine (CPU, flags, read bandwidth),
weight bytes a decode step reads, the tables and the summary files."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ENGINES = {
    "ours": "edgecloud",
    "genai": "onnxruntime-genai",
    "llama.cpp": "llama.cpp",
    "ovgenai": "openvino-genai",
}
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


@dataclass
class Result:
    engine: str  # a value of ENGINES
    precision: str
    threads: int
    decode_tps_1: float
    decode_tps_4: float
    prefill_tps: float
    prefill_tokens: int
    peak_rss_mb: float
    load_s: float
    kv_mb: float = 0.0
    huge_pages_mb: float = 0.0
    weight_mb_per_token: float = 0.0
    sample_text: str = ""
    rounds: list[dict[str, float]] = field(default_factory=list)


def cpu_info() -> dict[str, object]:
    """The CPU's model name and the flags that decide the kernels (results differ by CPU)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags], "cpus": os.cpu_count()}


def read_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """This machine's memory read bandwidth (GB/s), what a decode step's weights are bound by:
    the best of ``repeats`` passes of a dot product of ``mb`` MB with itself (read once, too
    big for the caches), on one thread and split over every CPU (BLAS lets go of the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(mb * 2**20 // 4, np.float32)
    best = float("inf")
    for workers in sorted({1, os.cpu_count() or 1}):
        cuts = np.linspace(0, src.size, workers + 1, dtype=np.int64)
        parts = [src[a:b] for a, b in itertools.pairwise(cuts)]
        with ThreadPoolExecutor(workers) as pool:
            for _ in range(repeats):
                t = time.perf_counter()
                list(pool.map(lambda p: np.dot(p, p), parts))
                best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


def onnx_weight_bytes(graph: Path) -> int:
    """Bytes of every initializer, less tables only gathered from (the embedding: one row)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    sizes: dict[str, int] = {}
    for init in model.graph.initializer:
        ext = {e.key: e.value for e in init.external_data}
        sizes[init.name] = int(ext["length"]) if "length" in ext else len(init.raw_data)
    users: dict[str, set[str]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            kind = "gather" if node.op_type.startswith("Gather") and i != 1 else node.op_type
            users.setdefault(name, set()).add(kind)
    gathered_only = {n for n, u in users.items() if u == {"gather"}}
    return sum(size for name, size in sizes.items() if name not in gathered_only)


def weight_bytes_per_token(kind: str, path: Path) -> int:
    """What one decode step reads, by engine: ONNX initializers, GGUF tensors, or OpenVINO's
    weights file (its tied embedding is the LM head too)."""
    if kind == "llama.cpp":
        from bench.edge_peer_llama import weight_bytes_per_token as gguf_bytes

        return gguf_bytes(path)
    if kind == "ovgenai":
        return (path / "openvino_model.bin").stat().st_size
    return onnx_weight_bytes(path / "model.onnx")


def results_table(
    results: list[Result], duels: dict[str, dict[str, float]], bandwidth: float
) -> tuple[str, list[dict]]:
    """Every configuration's row; our rows name their paired ratio to onnxruntime-genai."""
    lines = [
        "| engine | precision | decode tok/s (1) | decode tok/s (4 conc.) | prefill tok/s "
        "| peak RSS MB (KV MB, huge pages MB) | weights MB/token | bandwidth limit tok/s "
        "| of limit | paired vs onnxruntime-genai (1) |",
        "|" + "---|" * 10,
    ]
    rows = []
    for r in results:
        limit = bandwidth * 1e3 / r.weight_mb_per_token
        duel = duels.get(r.precision, {}) if r.engine == "edgecloud" else {}
        paired = duel.get("ratio_median")
        vs = ""
        if paired:
            fwd, rev = duel["ratio_median_forward"], duel["ratio_median_reverse"]
            vs = (
                f"{paired:.2f}x (ours made first {fwd:.2f}x, genai first {rev:.2f}x; "
                f"4 KB pages {duel['ratio_small_pages_median']:.2f}x)"
            )
        rows.append(
            {
                **{k: v for k, v in asdict(r).items() if k != "rounds"},
                "bandwidth_limit_tps": limit,
                "fraction_of_limit": r.decode_tps_1 / limit,
                "vs_genai_paired": paired,
                "rounds": r.rounds,
            }
        )
        rss = f"{r.peak_rss_mb:.0f} ({r.kv_mb:.0f}, {r.huge_pages_mb:.0f})" if r.peak_rss_mb else ""
        lines.append(
            f"| {r.engine} | {r.precision} | {r.decode_tps_1:.1f} | {r.decode_tps_4:.1f} "
            f"| {r.prefill_tps:.0f} | {rss} | {r.weight_mb_per_token:.0f} | {limit:.0f} "
            f"| {100 * r.decode_tps_1 / limit:.0f}% | {vs} |"
        )
    return "\n".join(lines), rows


def goal_table(results: list[Result], chosen: str, bandwidth: float) -> tuple[str, dict]:
    """Our variants against each peer's best, single stream and 4 streams: the quality gate's
    pick on this CPU (the goals are about it), then the others (what a CPU where they pass gets)."""
    ours = [r for r in results if r.engine == "edgecloud" and " " not in r.precision]
    ours.sort(key=lambda r: (r.precision != chosen, -r.decode_tps_1))
    if not ours or ours[0].precision != chosen:
        return "", {}
    lines = [
        "| ours | peer (its best) | peer tok/s (1 / 4 conc.) | ours tok/s (1 / 4 conc.) "
        "| ours / peer (1 / 4 conc.) |",
        "|---|---|---|---|---|",
    ]
    goals: dict[str, dict] = {}
    for mine in ours:
        share = mine.decode_tps_1 * mine.weight_mb_per_token / bandwidth / 1e3
        goals[mine.precision] = {"gate_pick": mine.precision == chosen, "of_bandwidth": share}
        for engine in ("llama.cpp", "openvino-genai", "onnxruntime-genai"):
            peers = [r for r in results if r.engine == engine]
            if not peers:
                continue
            one = max(peers, key=lambda r: r.decode_tps_1)
            four = max(peers, key=lambda r: r.decode_tps_4)
            ratio = (mine.decode_tps_1 / one.decode_tps_1, mine.decode_tps_4 / four.decode_tps_4)
            goals[mine.precision][engine] = {
                "best_1": one.precision, "best_4": four.precision, "ratio": ratio
            }  # fmt: skip
            name = f"**{mine.precision}** (gate)" if mine.precision == chosen else mine.precision
            lines.append(
                f"| {name} | {engine} ({one.precision} / {four.precision}) "
                f"| {one.decode_tps_1:.1f} / {four.decode_tps_4:.1f} "
                f"| {mine.decode_tps_1:.1f} / {mine.decode_tps_4:.1f} "
                f"| {ratio[0]:.2f}x / {ratio[1]:.2f}x |"
            )
    lines.append(
        f"\nOurs ({chosen}, the gate's pick), single stream: "
        f"{100 * goals[chosen]['of_bandwidth']:.0f}% of the bandwidth limit."
    )
    return "\n".join(lines), goals


def write_report(
    sections: list[tuple[int, list[Result], dict[str, dict[str, float]]]],
    meta: dict,
    args: argparse.Namespace,
    raw_dir: Path,
) -> None:
    """Print the tables and write ``edge_decode.{json,md}`` to ``args.out``."""
    bandwidth, chosen = meta["read_bandwidth_gbs"], meta["gate_variant"]
    cpu = meta["cpu"]
    md = [
        f"# Edge decode: {meta['model']}",
        "",
        f"CPU: {cpu['model']} ({cpu['cpus']} CPUs; flags {', '.join(cpu['flags'])}). The "
        f"quality gate picks **{chosen}** on this CPU. Median of {args.rounds} alternating "
        f"rounds, each configuration in a fresh process, the same thread count for every "
        f"engine. Decode: greedy, {args.new_tokens} new tokens per prompt, stop tokens ignored; "
        "4 conc. = steady state of 4 streams (our slots; llama.cpp's parallel sequences; the "
        f"other peers' batch). Prefill: a {args.prefill_tokens}-token prompt. llama.cpp: "
        "`llama-batched-bench` on the shipped Q4_1 GGUF and Q4_0/Q8_0 made from the model "
        "store's folder (dequantized from that Q4_1): every variant of every engine descends "
        "from the same Q4_1 weights. Paired: median ratio of back-to-back single-stream runs "
        "of ours and onnxruntime-genai in one process, both creation orders pooled. "
        f"Bandwidth limit: this machine's read bandwidth, {bandwidth:.1f} GB/s (a numpy dot "
        "product over 512 MB, best of one thread and all), / weight bytes read per token.",
        "",
    ]
    out_sections = []
    for threads, results, duels in sections:
        text, rows = results_table(results, duels, bandwidth)
        goals_text, goals = goal_table(results, chosen, bandwidth)
        print(f"\n{threads} thread(s)\n{text}\n\n{goals_text}")
        md += [f"## {threads} thread(s)", "", text, "", goals_text, ""]
        out_sections.append(
            {"threads": threads, "results": rows, "paired_single_stream": duels, "goals": goals}
        )
    md += [f"Load average before/after: {meta['load_average_before']} / "
           f"{meta['load_average_after']}. Versions: {meta['versions']}.", ""]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "edge_decode"
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "sections": out_sections}, indent=2)
    )
    stem.with_suffix(".md").write_text("\n".join(md))
    for partial in raw_dir.glob("edge_decode.raw.t*.json"):  # progress files of this run
        partial.unlink()


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("onnxruntime", "onnxruntime-genai", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out
