"""Edge decode benchmark: our EdgeEngine against what an edge user would run instead.

The same model, prompts, thread count and machine, in one run. Peers, each skipped with a line
where it is not set up:
- llama.cpp (``scripts/setup_llama_cpp.sh``): ``llama-batched-bench`` on the default model's
  Q4_1 GGUF as shipped and on Q4_0 and Q8_0 made from it (``bench/edge_peer_llama.py``);
- OpenVINO GenAI on the CPU with int4 weights (``scripts/setup_openvino_genai.sh``; its worker
  runs in ``.venv-ovgenai``, ``bench/edge_peer_openvino.py``);
- onnxruntime-genai (``pip install onnxruntime-genai``; fp32 and int4 built by its own builder),
  also *paired*: both engines in one process, back to back, prompt by prompt.
For every configuration a fresh process measures decode tokens/s of one stream (greedy, stop
tokens ignored, ``--new-tokens`` per prompt) and of 4 concurrent streams (steady state, from the
moment all 4 have their first token), prefill tokens/s (one ``--prefill-tokens`` prompt) and its
peak RSS. Rounds alternate between configurations; the table shows the median round. The goal
table sets the variant the quality gate picks on this CPU against each peer's best. The
bandwidth limit of decode is the machine's read bandwidth (numpy) / weight bytes read per token.

Run: ``python bench/edge_decode.py [--threads 1,2] [--rounds 3]``; the summary goes to
``bench/results/edge_decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "bench" / "results" / "raw"  # progress files of a run (ignored by git)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.edge_decode_report import (  # noqa: E402
    ENGINES,
    Result,
    cpu_info,
    read_bandwidth_gbs,
    versions,
    weight_bytes_per_token,
    write_report,
)
from bench.edge_peer_openvino import VENV_PYTHON  # noqa: E402
from bench.edge_runners import GenaiRunner, OursRunner, peak_rss_mb  # noqa: E402

DUEL_ORDERS = ("forward", "reverse")  # engines made ours, genai, 4 KB / the reverse
SAMPLE_TOKENS = 12  # of the first answer, decoded into the report


# --- workers (each in a fresh process) -----------------------------------------------------------


def make_runner(kind: str, folder: Path, threads: int):
    if kind == "ours":
        return OursRunner(folder, threads)
    if kind == "genai":
        return GenaiRunner(folder, threads)
    from bench.edge_peer_openvino import OpenvinoGenaiRunner

    return OpenvinoGenaiRunner(folder, threads)


def worker_config(args: argparse.Namespace) -> dict:
    """Every measurement of one engine on the prompts of ``--ids``, and the process's peak RSS."""
    prompts = json.loads(Path(args.ids).read_text())
    chats, long_ids = prompts["chats"], prompts["long"]
    runner = make_runner(args.worker, Path(args.folder), args.threads)
    n = dt = 0.0
    sample: list[int] = []
    for ids in chats:
        tps, tokens = runner.single(ids, args.new_tokens)
        n += len(tokens) - 1
        dt += (len(tokens) - 1) / tps
        sample = sample or tokens[:SAMPLE_TOKENS]
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
        "sample_tokens": sample,
        "peak_rss_mb": peak_rss_mb(),
    }


def worker_duel(args: argparse.Namespace) -> dict:
    """Ours (default config), genai and ours without huge pages, in one process, single
    stream, prompt by prompt, who goes first rotating: paired measurements that see the same
    machine load. Returns (ours, genai, ours on 4 KB pages) tok/s per prompt.

    Where an ONNX Runtime session's weights land in 4 KB pages decides how fast it decodes: in
    a process, sessions made later decoded 3-17% faster than earlier ones, and one made in the
    freed memory of the first was slow again. Our engine collapses its memory into huge pages
    and no longer depends on it; genai's session and the 4 KB ablation do. So the engines are
    made in the order ``args.duel_order`` says, and the caller runs both orders; an unused
    engine of ours takes the first place."""
    chats = json.loads(Path(args.ids).read_text())["chats"]
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


# --- orchestration ---------------------------------------------------------------------------


def spawn(
    kind: str, folder: Path, args: argparse.Namespace, ids: Path, folder2: Path | None = None
) -> dict:
    """One worker process (the OpenVINO GenAI worker with its own venv's Python)."""
    python = VENV_PYTHON if kind == "ovgenai" else Path(sys.executable)
    cmd = [
        str(python), __file__, "--worker", kind, "--folder", str(folder), "--ids", str(ids),
        "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
        "--duel-rounds", str(args.duel_rounds),
        "--duel-order", getattr(args, "duel_order", "forward"),
    ]  # fmt: skip
    if folder2 is not None:
        cmd += ["--folder2", str(folder2)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker {kind} {folder} failed:\n{proc.stderr[-3000:]}")


def run_config(kind: str, folder: Path, args: argparse.Namespace, ids: Path) -> dict:
    """One round of one configuration: a worker, or llama.cpp's own benchmark."""
    if kind != "llama.cpp":
        return spawn(kind, folder, args, ids)
    from bench.edge_peer_llama import measure as llama_measure

    prompts = json.loads(ids.read_text())
    prompt_tokens = round(statistics.mean(len(c) for c in prompts["chats"]))
    got = llama_measure(folder, args.threads, prompt_tokens, args.new_tokens, len(prompts["long"]))
    return {**got.__dict__, "kv_mb": 0.0, "huge_pages_mb": 0.0, "sample_tokens": []}


def genai_model(model_dir: Path, identity: str, precision: str) -> Path:
    from routing.model_store import home_dir

    out = home_dir() / "bench" / "genai" / identity / precision
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    cache = tmp.with_name(".cache")
    proc = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir),
         "-o", str(tmp), "-e", "cpu", "-p", precision, "-c", str(cache)],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai builder failed: {proc.stderr[-2000:]}")
    tmp.rename(out)
    return out


def peer_configs(args: argparse.Namespace, info) -> tuple[list[tuple[str, str, Path]], dict]:
    """The peers' configurations that are set up here, and their versions."""
    configs: list[tuple[str, str, Path]] = []
    found: dict[str, str] = {}
    from bench import edge_peer_llama

    ready = edge_peer_llama.available(info.identity)
    for quant in filter(None, args.llama.split(",")):
        if quant in ready:
            configs.append(("llama.cpp", quant, edge_peer_llama.gguf_path(info.identity, quant)))
        else:
            print(f"llama.cpp {quant}: not set up (scripts/setup_llama_cpp.sh)", file=sys.stderr)
    if ready:
        found["llama.cpp"] = edge_peer_llama.version()
    from bench import edge_peer_openvino as ov

    for precision in filter(None, args.openvino.split(",")):
        folder = ov.model_folder(info.identity)
        if precision != "int4" or not (ov.available() and ov.complete(folder)):
            print(
                f"openvino-genai {precision}: not set up (scripts/setup_openvino_genai.sh)",
                file=sys.stderr,
            )
            continue
        configs.append(("ovgenai", precision, folder))
        made = json.loads((folder / ov.MARKER).read_text())
        found["openvino-genai"] = made["versions"]["openvino-genai"]
    for precision in filter(None, args.genai.split(",")):
        try:
            configs.append(("genai", precision, genai_model(info.path, info.identity, precision)))
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"onnxruntime-genai {precision}: not available ({exc})", file=sys.stderr)
    return configs, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="store name or HF folder (default model)")
    ap.add_argument("--variants", default="fp32,int8,int4", help="our edge variants")
    ap.add_argument("--llama", default="Q4_1,Q4_0,Q8_0", help="llama.cpp GGUFs ('' = none)")
    ap.add_argument("--openvino", default="int4", help="OpenVINO GenAI weights ('' = none)")
    ap.add_argument("--genai", default="fp32,int4", help="onnxruntime-genai precisions ('' = none)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument(
        "--duel-rounds", type=int, default=3, help="paired ours/genai passes over the prompts"
    )
    ap.add_argument(
        "--worker", choices=("ours", "genai", "ovgenai", "duel"), help=argparse.SUPPRESS
    )
    ap.add_argument("--duel-order", choices=DUEL_ORDERS, default="forward", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--folder2", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        out = worker_duel(args) if args.worker == "duel" else worker_config(args)
        print("RESULT " + json.dumps(out), flush=True)
        return

    from bench.edge_runners import prompt_ids
    from edge_runtime.export import ensure_export
    from edge_runtime.quality_gate import choose_variant
    from routing.model_store import DEFAULT_MODEL, resolve
    from routing.prompt import PromptFormatter

    info = resolve(args.model or DEFAULT_MODEL)
    chosen = choose_variant(info.path).chosen
    configs: list[tuple[str, str, Path]] = []
    export_s: dict[str, float] = {}
    for v in filter(None, args.variants.split(",")):
        graph = ensure_export(info.path, v)
        export_s[v] = graph.meta.export_seconds
        configs.append(("ours", v, graph.folder))
    peers, peer_versions = peer_configs(args, info)
    configs += peers
    chats, long_ids = prompt_ids(info.path, args.prefill_tokens)
    ids = Path(tempfile.mkdtemp(prefix="edge-decode-")) / "prompts.json"
    ids.write_text(json.dumps({"chats": chats, "long": long_ids}))
    meta = {
        "model": info.name,
        "gate_variant": chosen,
        "cpu": cpu_info(),
        "rounds": args.rounds,
        "duel_rounds": args.duel_rounds,
        "new_tokens": args.new_tokens,
        "prefill_tokens": args.prefill_tokens,
        "read_bandwidth_gbs": read_bandwidth_gbs(),
        "load_average_before": os.getloadavg(),
        "export_seconds": export_s,
        "versions": {**versions(), **peer_versions},
    }
    fmt = PromptFormatter.from_folder(info.path)
    sections = []
    for threads in (int(t) for t in args.threads.split(",")):
        results, duels = measure(args, threads, configs, ids, fmt)
        sections.append((threads, results, duels))
    meta["load_average_after"] = os.getloadavg()
    write_report(sections, meta, args, RAW)


def measure(
    args: argparse.Namespace,
    threads: int,
    configs: list[tuple[str, str, Path]],
    ids: Path,
    fmt,
) -> tuple[list[Result], dict[str, dict[str, float]]]:
    """Alternating rounds of every configuration, then the paired single-stream duels."""
    run_args = argparse.Namespace(**{**vars(args), "threads": threads})
    raw: dict[tuple[str, str], list[dict]] = {(k, p): [] for k, p, _ in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for kind, prec, folder in order:
            res = run_config(kind, folder, run_args, ids)
            raw[(kind, prec)].append(res)
            RAW.mkdir(parents=True, exist_ok=True)
            (RAW / f"edge_decode.raw.t{threads}.json").write_text(
                json.dumps(
                    [{"engine": k, "precision": p, "rounds": v} for (k, p), v in raw.items()]
                )
            )
            print(
                f"threads {threads} round {r + 1} {ENGINES[kind]} {prec}: decode "
                f"{res['decode_tps_1']:.1f} tok/s, x4 {res['decode_tps_4']:.1f}, prefill "
                f"{res['prefill_tps']:.0f}, rss {res['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    duels = paired_duels(run_args, configs, ids)
    results: list[Result] = []
    for kind, prec, folder in configs:
        rounds = raw[(kind, prec)]
        med = {
            k: statistics.median(x[k] for x in rounds) for k in rounds[0] if k != "sample_tokens"
        }
        results.append(
            Result(
                engine=ENGINES[kind],
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
                weight_mb_per_token=weight_bytes_per_token(kind, folder) / 1e6,
                sample_text=fmt.decode(rounds[0]["sample_tokens"]),
                rounds=[{k: v for k, v in x.items() if k != "sample_tokens"} for x in rounds],
            )
        )
    return results, duels


def paired_duels(
    run_args: argparse.Namespace, configs: list[tuple[str, str, Path]], ids: Path
) -> dict[str, dict[str, float]]:
    """Ours against onnxruntime-genai back to back in one process, per precision both have."""
    duels: dict[str, dict[str, float]] = {}
    ours_by_prec = {p: f for k, p, f in configs if k == "ours"}
    for kind, prec, folder in configs:
        if kind != "genai" or prec not in ours_by_prec:
            continue
        by_order = {}
        for order in DUEL_ORDERS:  # both creation orders, pooled (see worker_duel)
            order_args = argparse.Namespace(**{**vars(run_args), "duel_order": order})
            by_order[order] = spawn("duel", ours_by_prec[prec], order_args, ids, folder)
        triples = [t for order in DUEL_ORDERS for t in by_order[order]["pairs"]]
        ratios = [t[0] / t[1] for t in triples]
        duels[prec] = {
            "ratio_median": statistics.median(ratios),
            **{
                f"ratio_median_{order}": statistics.median(t[0] / t[1] for t in v["pairs"])
                for order, v in by_order.items()
            },
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_small_pages_median": statistics.median(t[2] / t[1] for t in triples),
            "ours_median_tps": statistics.median(t[0] for t in triples),
            "genai_median_tps": statistics.median(t[1] for t in triples),
            "pairs": len(triples),
        }
        d = duels[prec]
        print(
            f"threads {run_args.threads} paired {prec}: ours {d['ours_median_tps']:.1f} vs genai "
            f"{d['genai_median_tps']:.1f} tok/s, ratio median {d['ratio_median']:.2f}",
            flush=True,
        )
    return duels


if __name__ == "__main__":
    main()
