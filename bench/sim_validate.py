"""The simulator against live replays on this machine: the same small traces sent open-loop
through the real embedded default with both tiers (``edgecloud serve --cloud-device cpu``:
gateway, edge node, cloud node on loopback) and run in the simulator on ``embedded_fleet.yaml`` (the profiles measured here),
per policy; mean and p90 TTFT and end-to-end error (sim - live) / live. ``--repeats N`` runs
each live replay N times (each on a fresh ``serve``) and compares with their mean; the
``spread_*`` columns ((max - min) / mean over the repeats) are the live runs' own noise floor.

Each live run starts a fresh ``serve`` (nothing learned carries over, as in the simulator). The
simulator gets each request's *actual* completion tokens from the live run (the model may stop
before ``max_tokens``). With ``--warm`` the live nodes get two short requests first and the
simulated nodes report the rates those would leave (``simulate(warm_prompts=...)``); without it
both start cold. ``--live-from DIR`` simulates again against the live replies a run saved in
DIR (no live run: for checking a simulator change against the same live data).

    python bench/sim_validate.py --policies latency least_loaded round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import TRACES, machine, raw_dir, recorded_command, write_results
from bench._serve import embedded_default
from gateway.commands.replay import replay
from routing.policy_config import PolicyConfig
from routing.sim.fleet import load_fleet
from routing.sim.importers import import_azure, import_mooncake
from routing.sim.simulator import Simulator
from routing.sim.trace import TraceRequest, rescale_length, rescale_time

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "routing" / "sim" / "fleets" / "embedded_fleet.yaml"


def traces(n: int, rate: float) -> dict[str, list[TraceRequest]]:
    def fit(tr: list[TraceRequest], pf: float) -> list[TraceRequest]:
        tr = rescale_length(tr[:n], pf, 0.25, max_prompt=600, max_output=16)
        tr = [r.model_copy(update={"region": "local"}) for r in tr]
        span = max(1e-3, tr[-1].arrival_s - tr[0].arrival_s)
        return rescale_time(tr, (n / rate) / span)

    return {
        "azure_conv": fit(import_azure(TRACES / "AzureLLMInferenceTrace_conv.csv"), 0.25),
        "mooncake": fit(import_mooncake(TRACES / "mooncake_conversation_trace.jsonl"), 0.05),
    }


NODE_TOKEN = "simvalidate-0123456789abcdef0123456789abcdef"
WARM_PROMPTS = (24, 200)  # the prompt lengths each node is warmed with (``--warm``)
WARM_DECODE_TOKENS = 4


async def _calibrate(url: str, prof: Any, n: int, seed: int) -> tuple[float, float]:
    """Scale factors (prefill, decode) of a node now against its profile: a lone prompt of
    ``n`` tokens (twice, the faster counts) and one stream's decode steps."""
    import random

    import httpx

    from gateway.commands.profile import _ids, _stream

    cost = prof.cost_model()
    rng = random.Random(seed)
    headers = {"x-edgecloud-node-token": NODE_TOKEN}
    async with httpx.AsyncClient(timeout=300.0, headers=headers) as client:
        model = (await client.get(url + "/load")).json()["models"][0]
        t = min([(await _stream(client, url, model, _ids(rng, n), 1, 0))[0] for _ in range(2)])
        times: list[float] = []
        await _stream(client, url, model, _ids(rng, 64), 24, 1, times)
    want_p = prof.request_overhead_ms / 1000 + cost.prefill_ms(n) / 1000
    step = (times[-1] - times[1]) * 1000 / max(1, len(times) - 2) if len(times) > 3 else math.nan
    return t / want_p, (step / cost.decode_ms(1, 80) if math.isfinite(step) else 1.0)


async def _warm(url: str) -> tuple[float, float]:
    """Two short streams straight to the node (a node's first request pays one-off costs: the
    first torch call of each shape on a CPU cloud node took 0.58 s where a warm one takes
    0.1 s); the rates it then reports (prefill tokens/s, decode ms/token)."""
    import random

    import httpx

    from gateway.commands.profile import _ids, _stream

    rng = random.Random(3)
    async with httpx.AsyncClient(
        timeout=300.0, headers={"x-edgecloud-node-token": NODE_TOKEN}
    ) as c:
        model = (await c.get(url + "/load")).json()["models"][0]
        for n in WARM_PROMPTS:
            await _stream(c, url, model, _ids(rng, n), WARM_DECODE_TOKENS, 0)
        state = (await c.get(url + "/load")).json()
        return state["prefill_tokens_per_s"], state["decode_ms_per_token"]


async def _replay_sampled(
    url: str, trace: list[TraceRequest], nodes: dict[str, tuple[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, tuple[float, float]]]:
    """Replay while polling each node's ``/load`` every 0.5 s; the scale factors (prefill,
    decode) are the medians, over samples taken while the node had work, of what its own
    EWMAs report against what its profile says for the same work."""
    import httpx

    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in nodes}
    done = asyncio.Event()

    async def sample() -> None:
        headers = {"x-edgecloud-node-token": NODE_TOKEN}
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as client:
            while not done.is_set():
                for kind, (nurl, prof) in nodes.items():
                    try:
                        st = (await client.get(nurl + "/load")).json()
                    except httpx.HTTPError:
                        continue
                    cost = prof.cost_model()
                    busy = st["running"] + st["waiting"]
                    if busy and st["prefill_tokens_per_s"] > 0 and st["decode_ms_per_token"] > 0:
                        chunk = 256 if kind == "edge" else 64
                        want_tps = 1000.0 * chunk / cost.chunk_ms(0, chunk)
                        want_dec = cost.decode_ms(max(1, st["running"]), 300)
                        samples[kind].append(
                            (
                                want_tps / st["prefill_tokens_per_s"],
                                st["decode_ms_per_token"] / want_dec,
                            )
                        )
                await asyncio.sleep(0.5)

    task = asyncio.create_task(sample())
    try:
        live = await replay(url, trace)
    finally:
        done.set()
        await task
    factors = {}
    for kind, xs in samples.items():
        if xs:
            factors[kind] = (
                float(np.median([x[0] for x in xs])),
                float(np.median([x[1] for x in xs])),
            )
        else:
            factors[kind] = (1.0, 1.0)
    return live, factors


def _scaled(fleet_path: Path, out: Path, factors: dict[str, tuple[float, float]]) -> Path:
    """A copy of the fleet whose profiles are scaled by ``factors[node kind]``."""
    import yaml

    from routing.sim.profiles import save_profile

    spec = load_fleet(fleet_path)
    data = yaml.safe_load(fleet_path.read_text())
    for node, raw in zip(spec.nodes, data["nodes"], strict=True):
        prof = spec.profile(node)
        fp, fd = factors[node.kind]
        prof = prof.model_copy(
            update={
                "request_overhead_ms": prof.request_overhead_ms * fp,
                "prefill": [q.model_copy(update={"ms": q.ms * fp}) for q in prof.prefill],
                "decode": [
                    q.model_copy(update={"ms_per_step": q.ms_per_step * fd}) for q in prof.decode
                ],
            }
        )
        path = out / f"calibrated_{node.kind}.json"
        save_profile(prof, path)
        raw["profile"] = path.name  # relative to the fleet file beside it
    path = out / "calibrated_fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def _gateway_overhead(url: str, port: int, n: int = 32, pairs: int = 8) -> float:
    """The gateway's own time to first token (ms): the median, over ``pairs`` prompts of ``n``
    token ids with one output token, of the TTFT through the gateway less that of the same
    prompt sent straight to the node the gateway chose (decision, relay, the extra hop). The
    profiles time the nodes alone; the replay goes through the gateway."""
    import random
    import time

    import httpx

    from gateway.commands.profile import _ids

    rng = random.Random(11)
    nodes = {"edge": f"http://127.0.0.1:{port + 1}", "cloud": f"http://127.0.0.1:{port + 2}"}
    headers = {"x-edgecloud-node-token": NODE_TOKEN}

    async def ttft(client: httpx.AsyncClient, base: str, ids: list[int]) -> tuple[float, str]:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "stream": True}
        t0 = time.perf_counter()
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break
            return time.perf_counter() - t0, r.headers.get("x-edgecloud-tier", "")

    diffs: list[float] = []
    async with httpx.AsyncClient(timeout=120.0, headers=headers) as client:
        model = (await client.get(nodes["edge"] + "/load")).json()["models"][0]
        for _ in range(pairs):
            ids = _ids(rng, n)
            via, tier = await ttft(client, url, ids)
            ids = _ids(rng, n)  # a fresh prompt: no prefix hit on either side
            direct, _ = await ttft(client, nodes.get(tier, nodes["edge"]), ids)
            diffs.append(1000.0 * (via - direct))
    return max(0.0, float(np.median(diffs)))


def _profiled_fleet(fleet_path: Path, out: Path) -> Path:
    """A copy of the fleet with profiles measured now, by ``edgecloud profile``, on a fresh
    embedded default (this machine's speed today: profiles of another machine, or of this
    one under other load, are the largest error there is)."""
    import subprocess

    import yaml

    data = yaml.safe_load(fleet_path.read_text())
    with embedded_default([], log_path=out / "profile_serve.log") as url:
        port = int(url.rsplit(":", 1)[1])
        for raw in data["nodes"]:
            off = {"edge": 1, "cloud": 2}[raw["kind"]]
            path = out / f"profile_{raw['kind']}.json"
            cmd = [sys.executable, "-m", "gateway.cli", "profile", "--out", str(path)]
            cmd += ["--node", f"http://127.0.0.1:{port + off}"]
            cmd += ["--notes", f"{raw['kind']} node of the embedded default, by sim_validate"]
            # the replays' open-loop rates keep a few requests in flight: batches beyond 8
            # never happen, and on a CPU cloud node they take most of the profiling time
            cmd += ["--batches", "1", "2", "4", "8"]
            subprocess.run(cmd, check=True)
            raw["profile"] = path.name  # relative to the fleet file beside it
        overhead = asyncio.run(_gateway_overhead(url, port))
        print(f"gateway overhead: {overhead:.1f} ms to the first token", flush=True)
        for gw in data["gateways"]:
            gw["overhead_ms"] = round(overhead, 2)
    path = out / "profiled_fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _live_run(
    args: argparse.Namespace, fleet: Any, trace: list[TraceRequest], policy: Path, out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """One live replay on a fresh ``serve``: its per-request results, the calibration, and
    the rates the nodes reported once warmed (by kind; empty without ``--warm``)."""
    with embedded_default(["--policy-file", str(policy)], log_path=out_dir / "serve.log") as url:
        factors = {"edge": (1.0, 1.0), "cloud": (1.0, 1.0)}
        port = int(url.rsplit(":", 1)[1])
        warm_rates: dict[str, tuple[float, float]] = {}
        if args.warm:
            for kind, off in (("edge", 1), ("cloud", 2)):
                warm_rates[kind] = asyncio.run(_warm(f"http://127.0.0.1:{port + off}"))
        if args.calibrate == "probe":
            for kind, off, n in (("edge", 1, 256), ("cloud", 2, 64)):
                node = next(nd for nd in fleet.nodes if nd.kind == kind)
                factors[kind] = asyncio.run(
                    _calibrate(f"http://127.0.0.1:{port + off}", fleet.profile(node), n, 7)
                )
            print(f"calibration factors (prefill, decode): {factors}", flush=True)
        if args.calibrate == "during":
            nodes = {
                kind: (
                    f"http://127.0.0.1:{port + off}",
                    fleet.profile(next(nd for nd in fleet.nodes if nd.kind == kind)),
                )
                for kind, off in (("edge", 1), ("cloud", 2))
            }
            live, factors = asyncio.run(_replay_sampled(url, trace, nodes))
            print(f"calibration factors (prefill, decode): {factors}", flush=True)
        else:
            live = asyncio.run(replay(url, trace))
    return live, factors, warm_rates


def _saved_warm_rates(run_dir: Path, trace: str, policy: str) -> dict[str, tuple[float, float]]:
    """The rates the live nodes reported after their warm-up in an earlier run (its JSON
    beside its folder), by node kind; empty where it recorded none."""
    path = run_dir.with_suffix(".json")
    if not path.exists():
        return {}
    for row in json.loads(path.read_text())["rows"]:
        if row["trace"] == trace and row["policy"] == policy:
            return {
                k: (float(v[0]), float(v[1])) for k, v in row.get("live_warm_rates", {}).items()
            }
    return {}


def _stats(x: list[float]) -> tuple[float, float]:
    a = np.asarray([v for v in x if v is not None and math.isfinite(v)])
    return (float(a.mean()), float(np.percentile(a, 90))) if a.size else (math.nan, math.nan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="+", default=["latency", "least_loaded", "round_robin"])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--rate", type=float, default=0.25, help="requests per second")
    ap.add_argument("--fleet", default=str(FLEET))
    ap.add_argument(
        "--calibrate",
        choices=["none", "probe", "during"],
        default="none",
        help="scale the profiles by this machine's speed now (its load changes from minute to "
        "minute): probe = one prompt and one decode on each node before the replay; during = "
        "the nodes' own EWMAs, polled while the replay runs",
    )
    ap.add_argument("--name", default="sim_validate")
    ap.add_argument(
        "--repeats", type=int, default=1, help="live replays per policy and trace (mean taken)"
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="send each node two short requests before the replay (the simulator's are warm)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="measure the nodes' profiles first (edgecloud profile) and simulate with those",
    )
    ap.add_argument(
        "--warm-from-live",
        action="store_true",
        help="with --warm: the simulated nodes start from the rates the live nodes reported "
        "after their warm-up (the live gateway's first view), not from their profiles'",
    )
    ap.add_argument(
        "--live-from",
        default=None,
        help="an earlier run's folder (bench/results/raw/NAME): simulate against its saved live "
        "replies "
        "(no live run; give that run's --fleet and --warm)",
    )
    args = ap.parse_args(argv)
    if args.warm_from_live and not args.warm:
        ap.error("--warm-from-live needs --warm (the live nodes' rates after their warm-up)")
    import os

    os.environ["EDGECLOUD_NODE_TOKEN"] = NODE_TOKEN
    out_dir = raw_dir(args.name)  # per-run replies, profiles, logs
    if args.profile and not args.live_from:
        args.fleet = str(_profiled_fleet(Path(args.fleet), out_dir))
    fleet = load_fleet(args.fleet)
    rows: list[dict[str, Any]] = []
    for tname, trace in traces(args.requests, args.rate).items():
        for pol in args.policies:
            policy = out_dir / "policy.yaml"
            policy.write_text(f"policy: {pol}\n")
            fleet_path = Path(args.fleet)
            lives = []
            factors = {"edge": (1.0, 1.0), "cloud": (1.0, 1.0)}
            warm_rates: dict[str, tuple[float, float]] = {}
            if args.live_from:
                saved = Path(args.live_from) / f"{tname}_{pol}.jsonl"
                lives.append([json.loads(line) for line in saved.read_text().splitlines()])
                warm_rates = _saved_warm_rates(Path(args.live_from), tname, pol)
            for _ in range(0 if args.live_from else args.repeats):  # each on a fresh serve
                live, factors, warm_rates = _live_run(args, fleet, trace, policy, out_dir)
                lives.append(live)
            live = lives[0]
            if args.calibrate != "none":
                fleet_path = _scaled(Path(args.fleet), out_dir, factors)
            (out_dir / f"{tname}_{pol}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in live)
            )
            ok = [i for i, r in enumerate(live) if "error" not in r]
            sim_trace = [
                trace[i].model_copy(
                    update={
                        "output_tokens": max(
                            1, live[i].get("completion_tokens") or trace[i].output_tokens
                        )
                    }
                )
                if "error" not in live[i]
                else trace[i]
                for i in range(len(trace))
            ]
            sim_trace = [r.model_copy(update={"max_tokens": None}) for r in sim_trace]
            sim = Simulator(
                load_fleet(fleet_path),
                PolicyConfig(policy=pol),
                warm_prompts=WARM_PROMPTS if args.warm else (),
                warm_rates={
                    nd.id: tuple(warm_rates[nd.kind]) for nd in fleet.nodes if nd.kind in warm_rates
                }
                if args.warm and args.warm_from_live
                else None,
                warm_decode_tokens=WARM_DECODE_TOKENS,
            )
            sim_warm_rates = {
                st.kind.value: (st.prefill_tokens_per_s, st.decode_ms_per_token)
                for st in sim.states
            }
            res = sim.run(sim_trace)
            per_run = np.asarray(
                [
                    _stats([lv[i].get("ttft_s") for i in ok])
                    + _stats([lv[i].get("e2e_s") for i in ok])
                    for lv in lives
                ]
            )  # [repeats, (mean ttft, p90 ttft, mean e2e, p90 e2e)]
            lt, lp, le, lq = (float(x) for x in per_run.mean(axis=0))
            spread = (per_run.max(axis=0) - per_run.min(axis=0)) / per_run.mean(axis=0)
            st, sp = _stats([res.ttft_s[i] for i in ok])
            se, sq = _stats([res.e2e_s[i] for i in ok])
            live_cloud = np.mean([live[i]["tier"] == "cloud" for i in ok]) if ok else math.nan
            sim_cloud = np.mean(
                [res.node_kinds[res.node[i]] == "cloud" for i in ok if res.node[i] >= 0]
            )
            row = {
                "trace": tname,
                "policy": pol,
                "requests": len(trace),
                "live_failed": len(trace) - len(ok),
                "live_mean_ttft_s": lt,
                "sim_mean_ttft_s": st,
                "err_mean_ttft": st / lt - 1,
                "live_p90_ttft_s": lp,
                "sim_p90_ttft_s": sp,
                "err_p90_ttft": sp / lp - 1,
                "live_mean_e2e_s": le,
                "sim_mean_e2e_s": se,
                "err_mean_e2e": se / le - 1,
                "live_p90_e2e_s": lq,
                "sim_p90_e2e_s": sq,
                "err_p90_e2e": sq / lq - 1,
                "live_cloud_share": float(live_cloud),
                "repeats": len(lives),
                # (max - min) / mean of the live figure over the repeats: the noise floor
                **{
                    f"spread_{k}": float(x)
                    for k, x in zip(
                        ("mean_ttft", "p90_ttft", "mean_e2e", "p90_e2e"), spread, strict=True
                    )
                },
                "sim_cloud_share": float(sim_cloud),
                "calibration": factors,
                # (prefill tokens/s, decode ms/token) each node reports at the start
                "live_warm_rates": warm_rates,
                "sim_warm_rates": sim_warm_rates,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = [
        "trace",
        "policy",
        "live_mean_ttft_s",
        "sim_mean_ttft_s",
        "err_mean_ttft",
        "err_p90_ttft",
        "live_mean_e2e_s",
        "sim_mean_e2e_s",
        "err_mean_e2e",
        "err_p90_e2e",
        "live_cloud_share",
        "sim_cloud_share",
        "spread_mean_ttft",
        "spread_mean_e2e",
    ]
    lines = [
        "# Simulator vs live (embedded default on this machine)",
        "",
        f"`{recorded_command('sim_validate.py', sys.argv[1:], ('--fleet',))}`",
        "",
        "| " + " | ".join(cols) + " |",
        "|---" * len(cols) + "|",
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
            + " |"
        )
    write_results(args.name, {"machine": machine(), "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
