"""Edge decode benchmark: our EdgeEngine (fp32, int8, int4) against onnxruntime-genai.

Same model folder, same prompts, same machine, same run. For every configuration a fresh
worker process measures:
- decode tokens/s, single stream (greedy, stop tokens ignored, ``--new-tokens`` per prompt);
- decode tokens/s, 4 concurrent streams (steady state: from the moment all 4 have their first
  token until all are done);
- prefill tokens/s (one prompt of about ``--prefill-tokens`` tokens, time to first token);
- peak RSS of the worker.
Rounds alternate between configurations (``--rounds``); the table shows the median round.
Because a shared machine's load drifts, the single-stream comparison with onnxruntime-genai is
also measured *paired*: both engines in one process, back to back, prompt by prompt.
The memory-bandwidth limit of decode is weight bytes read per token / copy bandwidth, measured
here with numpy (read + write counted). Our runtime also runs onnxruntime-genai's own graphs
("genai graph" rows), which separates the generation loop from the graph.

onnxruntime-genai is not a project dependency: ``pip install onnxruntime-genai`` to compare.
Its models are built by its own builder from the same HF folder and cached under the
edgecloud home. Run: ``python bench/edge_decode.py [--threads 1,2] [--rounds 3]``; results go
to ``bench/results/edge_decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "bench" / "results" / "raw"  # progress files of a run (ignored by git)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
]
DUEL_ORDERS = ("forward", "reverse")  # engines made ours, genai, 4 KB / the reverse
LONG_TEXT = (
    "Edge nodes answer short requests close to the user, while a cloud engine with continuous "
    "batching serves the long ones. The router predicts the time to first token and the total "
    "latency of every eligible node from measured rates, and picks the node that finishes first. "
)


@dataclass
class Result:
    engine: str  # "edgecloud" | "onnxruntime-genai"
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
        config = EdgeEngineConfig(slots=4, threads=threads, huge_pages=huge_pages)
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


def make_runner(kind: str, folder: Path, threads: int) -> OursRunner | GenaiRunner:
    return OursRunner(folder, threads) if kind == "ours" else GenaiRunner(folder, threads)


# --- workers (each in a fresh process) -----------------------------------------------------------


def worker_config(args: argparse.Namespace) -> dict:
    """Every measurement of one engine, and the process's peak RSS."""
    from routing.prompt import PromptFormatter

    model_dir = Path(args.model_dir)
    chats, long_ids = prompt_ids(model_dir, args.prefill_tokens)
    runner = make_runner(args.worker, Path(args.folder), args.threads)
    n = dt = 0.0
    sample = ""
    for ids in chats:
        tps, tokens = runner.single(ids, args.new_tokens)
        n += len(tokens) - 1
        dt += (len(tokens) - 1) / tps
        sample = sample or PromptFormatter.from_folder(model_dir).decode(tokens[:12])
    multi = runner.concurrent(chats[0], args.new_tokens)
    best = min(runner.prefill_s(long_ids) for _ in range(3))
    runner.close()
    return {
        "decode_tps_1": n / dt,
        "decode_tps_4": multi,
        "prefill_tps": len(long_ids) / best,
        "prefill_tokens": len(long_ids),
        "load_s": runner.load_s,
        "kv_mb": runner.kv_mb,
        "huge_pages_mb": runner.huge_pages_mb,
        "sample_text": sample,
        "peak_rss_mb": peak_rss_mb(),
    }


def worker_duel(args: argparse.Namespace) -> dict:
    """Ours (default config), genai and ours without huge pages, in one process, single
    stream, prompt by prompt, who goes first rotating: paired measurements that see the same
    machine load. Returns (ours, genai, ours on 4 KB pages) tok/s per prompt.

    Where an ONNX Runtime session's weights land in 4 KB pages decides how fast it decodes: in
    a process, sessions made later decoded 3-17% faster than earlier ones (by hand, whichever
    graph or engine), and one made in the freed memory of the first was slow again. Our
    engine collapses its memory into huge pages and no longer depends on it; genai's session
    and the 4 KB ablation do. So the engines are made in the order ``args.duel_order`` says,
    and the caller runs both orders; an unused engine of ours takes the first place."""
    chats, _ = prompt_ids(Path(args.model_dir), args.prefill_tokens)
    placeholder = OursRunner(Path(args.folder), args.threads)
    makers = [
        lambda: OursRunner(Path(args.folder), args.threads),
        lambda: GenaiRunner(Path(args.folder2), args.threads),
        lambda: OursRunner(Path(args.folder), args.threads, huge_pages=False),
    ]
    order = range(len(makers)) if args.duel_order == "forward" else reversed(range(len(makers)))
    made = {k: makers[k]() for k in order}
    runners = [made[k] for k in range(len(makers))]
    triples: list[tuple[float, ...]] = []
    for r in range(args.duel_rounds):
        for i, ids in enumerate(chats):
            turn = (r * len(chats) + i) % len(runners)
            speed = [0.0] * len(runners)
            for k in [*range(turn, len(runners)), *range(turn)]:
                speed[k] = runners[k].single(ids, args.new_tokens)[0]
            triples.append(tuple(speed))
    for runner in (*runners, placeholder):
        runner.close()
    return {"pairs": triples}


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


def run_worker(args: argparse.Namespace) -> None:
    out = worker_duel(args) if args.worker == "duel" else worker_config(args)
    print("RESULT " + json.dumps(out), flush=True)


# --- orchestration ---------------------------------------------------------------------------


def copy_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Best of ``repeats`` numpy copies of ``mb`` MB; read + write bytes per second (GB/s)."""
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def weight_bytes_per_token(graph: Path) -> int:
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


def genai_model(model_dir: Path, identity: str, precision: str) -> Path:
    from routing.model_store import home_dir

    out = home_dir() / "bench" / "genai" / identity / precision
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(model_dir),
            "-o",
            str(tmp),
            "-e",
            "cpu",
            "-p",
            precision,
            "-c",
            str(tmp.with_name(".cache")),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai builder failed: {proc.stderr[-2000:]}")
    tmp.rename(out)
    return out


def spawn(
    kind: str, folder: Path, args: argparse.Namespace, model_dir: Path, folder2: Path | None = None
) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--folder",
        str(folder),
        "--model-dir",
        str(model_dir),
        "--threads",
        str(args.threads),
        "--new-tokens",
        str(args.new_tokens),
        "--prefill-tokens",
        str(args.prefill_tokens),
        "--duel-rounds",
        str(args.duel_rounds),
        "--duel-order",
        getattr(args, "duel_order", "forward"),
    ]
    if folder2 is not None:
        cmd += ["--folder2", str(folder2)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker {kind} {folder} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="store name or HF folder (default model)")
    ap.add_argument("--variants", default="fp32,int8,int4")
    ap.add_argument("--genai", default="fp32,int4", help="onnxruntime-genai precisions ('' = none)")
    ap.add_argument("--threads", default="1,2", help="intra-op thread counts, comma-separated")
    ap.add_argument(
        "--no-cross",
        dest="cross",
        action="store_false",
        help="skip running our runtime on onnxruntime-genai's graphs",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument(
        "--duel-rounds", type=int, default=3, help="paired ours/genai passes over the prompts"
    )
    ap.add_argument("--worker", choices=("ours", "genai", "duel"), help=argparse.SUPPRESS)
    ap.add_argument("--duel-order", choices=DUEL_ORDERS, default="forward", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--folder2", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        run_worker(args)
        return

    from edge_runtime.export import ensure_export
    from routing.model_store import DEFAULT_MODEL, resolve

    info = resolve(args.model or DEFAULT_MODEL)
    configs: list[tuple[str, str, Path]] = []
    export_s: dict[str, float] = {}
    for v in filter(None, args.variants.split(",")):
        graph = ensure_export(info.path, v)
        export_s[v] = graph.meta.export_seconds
        configs.append(("ours", v, graph.folder))
    for p in filter(None, args.genai.split(",")):
        try:
            folder = genai_model(info.path, info.identity, p)
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"onnxruntime-genai {p}: not available ({exc})", file=sys.stderr)
            continue
        configs.append(("genai", p, folder))
        if args.cross:  # our runtime on genai's graph: separates the loop from the graph
            configs.append(("ours", f"{p} (genai graph)", folder))

    bandwidth = copy_bandwidth_gbs()
    load_before = os.getloadavg()
    sections = []
    for threads in (int(t) for t in args.threads.split(",")):
        results, duels = measure(args, threads, configs, info.path)
        sections.append((threads, results, duels))
    report(sections, bandwidth, args, export_s, load_before, info.name)


def measure(
    args: argparse.Namespace, threads: int, configs: list[tuple[str, str, Path]], model_dir: Path
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """Alternating rounds of every configuration, then the paired single-stream duels."""
    run_args = argparse.Namespace(**{**vars(args), "threads": threads})
    raw: dict[tuple[str, str], list[dict]] = {(k, p): [] for k, p, _ in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for kind, prec, folder in order:
            res = spawn(kind, folder, run_args, model_dir)
            raw[(kind, prec)].append(res)
            RAW.mkdir(parents=True, exist_ok=True)
            (RAW / f"edge_decode.raw.t{threads}.json").write_text(
                json.dumps(
                    [{"engine": k, "precision": p, "rounds": v} for (k, p), v in raw.items()]
                )
            )
            print(
                f"threads {threads} round {r + 1} {kind:5s} {prec}: decode "
                f"{res['decode_tps_1']:.1f} tok/s, x4 {res['decode_tps_4']:.1f}, prefill "
                f"{res['prefill_tps']:.0f}, rss {res['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    duels: dict[str, dict[str, float]] = {}
    ours_by_prec = {p: f for k, p, f in configs if k == "ours"}
    for kind, prec, folder in configs:
        if kind != "genai" or prec not in ours_by_prec:
            continue
        by_order = {}
        for order in DUEL_ORDERS:  # both creation orders, pooled (see worker_duel)
            order_args = argparse.Namespace(**{**vars(run_args), "duel_order": order})
            by_order[order] = spawn("duel", ours_by_prec[prec], order_args, model_dir, folder)
        triples = [t for order in DUEL_ORDERS for t in by_order[order]["pairs"]]
        ratios = [t[0] / t[1] for t in triples]
        small = [t[2] / t[1] for t in triples]
        duels[prec] = {
            "ratio_median": statistics.median(ratios),
            **{
                f"ratio_median_{order}": statistics.median(t[0] / t[1] for t in v["pairs"])
                for order, v in by_order.items()
            },
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_small_pages_median": statistics.median(small),
            "ours_median_tps": statistics.median(t[0] for t in triples),
            "genai_median_tps": statistics.median(t[1] for t in triples),
            "ours_small_pages_median_tps": statistics.median(t[2] for t in triples),
            "pairs": len(triples),
        }
        d = duels[prec]
        print(
            f"threads {threads} paired {prec}: ours {d['ours_median_tps']:.1f} vs genai "
            f"{d['genai_median_tps']:.1f} tok/s, ratio median {d['ratio_median']:.2f} "
            f"[{d['ratio_min']:.2f}, {d['ratio_max']:.2f}] over {len(triples)} pairs (ours made "
            f"first {d['ratio_median_forward']:.2f}, genai first {d['ratio_median_reverse']:.2f}); 4 KB pages: "
            f"{d['ours_small_pages_median_tps']:.1f} tok/s, ratio {d['ratio_small_pages_median']:.2f}",
            flush=True,
        )
    results: list[Result] = []
    for kind, prec, folder in configs:
        rounds = raw[(kind, prec)]
        med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0] if k != "sample_text"}
        results.append(
            Result(
                engine="edgecloud" if kind == "ours" else "onnxruntime-genai",
                precision=prec,
                threads=threads,
                decode_tps_1=med["decode_tps_1"],
                decode_tps_4=med["decode_tps_4"],
                prefill_tps=med["prefill_tps"],
                prefill_tokens=int(med["prefill_tokens"]),
                peak_rss_mb=med["peak_rss_mb"],
                load_s=med["load_s"],
                kv_mb=med["kv_mb"],
                huge_pages_mb=med["huge_pages_mb"],
                weight_mb_per_token=weight_bytes_per_token(folder / "model.onnx") / 1e6,
                sample_text=rounds[0]["sample_text"],
                rounds=[{k: v for k, v in x.items() if k != "sample_text"} for x in rounds],
            )
        )
    return results, duels


def table(
    results: list[Result], duels: dict[str, dict[str, float]], bandwidth: float
) -> tuple[str, list[dict]]:
    genai = {r.precision: r for r in results if r.engine == "onnxruntime-genai"}
    genai.update({f"{p} (genai graph)": r for p, r in list(genai.items())})
    lines = [
        "| engine | precision | decode tok/s (1) | decode tok/s (4 conc.) | prefill tok/s "
        "| peak RSS MB (KV MB, huge pages MB) | weights MB/token | bandwidth limit tok/s | of limit "
        "| vs genai (1) |",
        "|" + "---|" * 10,
    ]
    rows = []
    for r in results:
        limit = bandwidth * 1e3 / r.weight_mb_per_token
        peer = genai.get(r.precision) if r.engine == "edgecloud" else None
        ratio = r.decode_tps_1 / peer.decode_tps_1 if peer else None
        duel = duels.get(r.precision, {}) if r.engine == "edgecloud" else {}
        paired = duel.get("ratio_median")
        vs = f"{ratio:.2f}x" if ratio else ""
        if paired:
            fwd, rev = duel["ratio_median_forward"], duel["ratio_median_reverse"]
            vs += (
                f" (paired {paired:.2f}x: ours made first {fwd:.2f}x, genai first {rev:.2f}x; "
                f"4 KB pages "
                f"{duel['ratio_small_pages_median']:.2f}x)"
            )
        rows.append(
            {
                **{k: v for k, v in asdict(r).items() if k != "rounds"},
                "bandwidth_limit_tps": limit,
                "fraction_of_limit": r.decode_tps_1 / limit,
                "vs_genai_single": ratio,
                "vs_genai_paired": paired,
                "rounds": r.rounds,
            }
        )
        lines.append(
            f"| {r.engine} | {r.precision} | {r.decode_tps_1:.1f} | {r.decode_tps_4:.1f} "
            f"| {r.prefill_tps:.0f} | {r.peak_rss_mb:.0f} ({r.kv_mb:.0f}, {r.huge_pages_mb:.0f}) "
            f"| {r.weight_mb_per_token:.0f} | {limit:.0f} | {100 * r.decode_tps_1 / limit:.0f}% "
            f"| {vs} |"
        )
    return "\n".join(lines), rows


def report(
    sections: list[tuple[int, list[Result], dict[str, dict[str, float]]]],
    bandwidth: float,
    args: argparse.Namespace,
    export_s: dict[str, float],
    load_before: tuple[float, float, float],
    model_name: str,
) -> None:
    meta = {
        "model": model_name,
        "rounds": args.rounds,
        "duel_rounds": args.duel_rounds,
        "new_tokens": args.new_tokens,
        "prefill_tokens": args.prefill_tokens,
        "copy_bandwidth_gbs_read_plus_write": bandwidth,
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "export_seconds": export_s,
        "versions": _versions(),
    }
    md = [
        f"# Edge decode: {model_name}",
        "",
        f"Median of {args.rounds} alternating rounds, each configuration in a fresh process. "
        f"Decode: greedy, {args.new_tokens} new tokens per prompt, stop tokens ignored; "
        "4 conc. = steady state of 4 streams of the same prompt (our slots; genai's static "
        f"batch). Prefill: a {args.prefill_tokens}-token prompt, time to first token. "
        "vs genai: ratio of the medians; paired: median ratio of back-to-back single-stream "
        "runs of both engines in one process, prompt by prompt (robust to load drifting "
        "during the run), pooled over two processes that make the engines in opposite orders "
        "(where a session's weights land in 4 KB pages changes its speed, a process's first "
        "session being slowest; our engine collapses its memory into huge pages, genai's "
        "session keeps its pages; an unused engine of ours is made first in both). 4 KB pages: "
        "the paired ratio of our engine with `huge_pages=False`. Our engine hands each token "
        "to its consumer as soon as it is sampled. "
        f"Bandwidth limit: copy bandwidth {bandwidth:.1f} GB/s (numpy, "
        "read+write counted) / weight bytes read per token. KV MB: our engine's preallocated "
        "cache (4 slots x 2048 tokens); genai sizes its cache per request.",
        "",
    ]
    out_sections = []
    for threads, results, duels in sections:
        text, rows = table(results, duels, bandwidth)
        print(f"\n{threads} intra-op thread(s)\n{text}")
        md += [f"## {threads} intra-op thread(s)", "", text, ""]
        out_sections.append({"threads": threads, "results": rows, "paired_single_stream": duels})
    md += [
        f"Load average before/after: {load_before} / {meta['load_average_after']} "
        f"({meta['cpus']} CPUs). Versions: {meta['versions']}.",
        "",
    ]
    print(f"\ncopy bandwidth {bandwidth:.1f} GB/s (read+write); load average {load_before}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "edge_decode"
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "sections": out_sections}, indent=2)
    )
    stem.with_suffix(".md").write_text("\n".join(md))
    for partial in RAW.glob("edge_decode.raw.t*.json"):  # progress files of this run
        partial.unlink()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("onnxruntime", "onnxruntime-genai", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


if __name__ == "__main__":
    main()
