"""What the gateway adds to a request: direct vs through our gateway vs through the LiteLLM proxy.

One fast fake upstream (``bench/fake_upstream.py``, its own process pinned to one core) and the
same load sent to it (a) directly, (b) through our gateway (one uvicorn worker with uvloop and
httptools, in-process fleet store polling the upstream's ``/load``, routing fully on: the prompt
is rendered, tokenized and block-hashed, the fleet read, a decision made) and (c) through the
LiteLLM proxy (installed by this script in its own virtualenv under ``.cache/``, one worker).
Loads: concurrency 1, 16 and 64, non-streaming and streaming (64 chunks). Reported per scenario:
p50/p99 latency, the p50/p99 added over direct, and requests/s. One more scenario checks that
tokenizing ~5,000-token prompts does not stall the event loop: short requests at concurrency 16
while another client keeps sending long prompts.

The load generator is ``wrk`` (with a Lua script) when installed, else an aiohttp client in its
own process; it never shares a core with the server under test. Cores, with N available:
server under test on core 0, upstream on core 1, load on core 2 (N >= 3); with 2 cores the load
shares core 1 with the upstream, except for the direct runs (load on core 0).

    python bench/gateway_overhead.py [--duration 8] [--no-litellm] [--concurrency 1,16,64]

Results: bench/results/gateway_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, table, write_results

ROOT = Path(__file__).resolve().parents[1]
MODEL_ALIAS = "auto"  # what clients ask for; each relay maps it to the upstream's model
SHORT_PROMPT = "Hi there! In one sentence, what is the capital of France?"
LONG_WORDS = [
    *("the", "report", "covers", "quarterly", "revenue,", "hiring", "plans,", "cloud"),
    *("budgets,", "launch", "dates,", "customer", "feedback", "from", "14", "regions"),
    *("and", "the", "risks", "we", "see", "for", "2027;"),
]
LITELLM_VENV = ROOT / ".cache" / "bench-litellm-venv"

WRK_LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("%(body)s", "rb")
wrk.body = f:read("*a")
f:close()

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %%d, "duration_us": %%d, "bytes": %%d, ' ..
    '"errors": {"connect": %%d, "read": %%d, "write": %%d, "status": %%d, "timeout": %%d}, ' ..
    '"p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "p999_us": %%d, "mean_us": %%f, "max_us": %%d}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.mean, latency.max))
end
"""


# ---- processes and cores ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cmd: list[str], core: int | None) -> list[str]:
    if core is None:
        return cmd
    if shutil.which("taskset"):
        return ["taskset", "-c", str(core), *cmd]
    return cmd  # run() falls back to sched_setaffinity


def _affinity(core: int | None) -> Any:
    if core is None or shutil.which("taskset") or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


@dataclass
class Cores:
    server: int | None  # the relay under test (or the upstream, for direct runs)
    upstream: int | None
    load: int | None  # load generator while a relay is under test
    load_direct: int | None  # load generator while the upstream itself is under test
    note: str

    @classmethod
    def plan(cls) -> Cores:
        avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(avail) >= 3:
            return cls(
                avail[0],
                avail[1],
                avail[2],
                avail[2],
                f"relay on core {avail[0]}, upstream on {avail[1]}, load on {avail[2]}",
            )
        if len(avail) == 2:
            a, b = avail
            return cls(
                a,
                b,
                b,
                a,
                f"relay on core {a}; upstream on core {b}; load on core {b} for relayed runs "
                f"(shared with the upstream), on core {a} for direct runs",
            )
        return cls(None, None, None, None, "one core: nothing pinned (results are not meaningful)")


class Proc:
    """A child process with its output in a log file; stopped (and reaped) on ``stop``."""

    def __init__(self, name: str, cmd: list[str], core: int | None, logdir: Path, **kw: Any):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(
            pinned(cmd, core),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_affinity(core),
            **kw,
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._log.close()


def http_get(url: str, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_post(url: str, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


def wait_ready(proc: Proc, url: str, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            status, _ = http_get(url, path)
            if status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f}s:\n{proc.tail()}")


# ---- request bodies --------------------------------------------------------------------------
def chat_body(prompt: str, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL_ALIAS,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def long_prompt(tokens: int) -> tuple[str, int]:
    """Varied English-like text of about ``tokens`` tokens (counted with the default model)."""
    from routing.model_store import DEFAULT_MODEL, resolve
    from routing.prompt import PromptFormatter

    fmt = PromptFormatter.from_folder(resolve(DEFAULT_MODEL).path)
    words = LONG_WORDS
    out: list[str] = []
    i = 0
    while True:
        out.extend(words[(i + k) % len(words)] for k in range(50))
        out.append(f"item {i}.")
        i += 1
        text = " ".join(out)
        n = len(fmt.encode_chat([{"role": "user", "content": text}]))
        if n >= tokens:
            return text, n


def check_reply(url: str, body: bytes, stream: bool, chunks: int) -> str | None:
    """None if the reply is a correct completion (all chunks and [DONE] for a stream)."""
    try:
        status, data, _ = http_post(url, "/v1/chat/completions", body)
    except (OSError, http.client.HTTPException) as exc:
        return f"request failed: {exc!r}"
    if status != 200:
        return f"HTTP {status}: {data[:300]!r}"
    if not stream:
        try:
            obj = json.loads(data)
            return None if obj["choices"][0]["message"]["content"] else "empty answer"
        except (ValueError, KeyError, IndexError) as exc:
            return f"bad JSON reply: {exc!r} {data[:200]!r}"
    events = [e for e in data.split(b"\n\n") if e.strip()]
    content = [e for e in events if b'"content"' in e and b'"t' in e]
    if not events or events[-1].strip() != b"data: [DONE]":
        return f"stream does not end with [DONE]: {data[-200:]!r}"
    if len(content) < chunks:
        return f"stream has {len(content)} content chunks, expected {chunks}"
    return None


# ---- load generators -------------------------------------------------------------------------
def run_wrk(url: str, body: bytes, conc: int, duration: float, core: int | None, tmp: Path) -> dict:
    body_file = tmp / f"body-{abs(hash(body))}.json"
    body_file.write_bytes(body)
    script = tmp / "post.lua"
    script.write_text(WRK_LUA % {"body": str(body_file)})
    cmd = [
        "wrk",
        "-t1",
        f"-c{conc}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "60s",
        "-s",
        str(script),
        url + "/v1/chat/completions",
    ]
    out = subprocess.run(
        pinned(cmd, core),
        capture_output=True,
        text=True,
        preexec_fn=_affinity(core),
        timeout=duration + 120,
    )
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            r = json.loads(line[8:])
            errs = r["errors"]
            return {
                "requests": r["requests"],
                "rps": r["requests"] / (r["duration_us"] / 1e6),
                "p50_ms": r["p50_us"] / 1000,
                "p90_ms": r["p90_us"] / 1000,
                "p99_ms": r["p99_us"] / 1000,
                "mean_ms": r["mean_us"] / 1000,
                "max_ms": r["max_us"] / 1000,
                "errors": sum(errs.values()),
                "error_detail": {k: v for k, v in errs.items() if v},
            }
    raise RuntimeError(f"wrk gave no result: {out.stdout[-500:]} {out.stderr[-500:]}")


def run_pyload(
    url: str,
    bodies: list[bytes] | bytes,
    conc: int,
    duration: float,
    core: int | None,
    tmp: Path,
    background: bool = False,
) -> dict | subprocess.Popen:
    """The aiohttp load generator in its own process (``_load`` below)."""
    bodies = [bodies] if isinstance(bodies, bytes) else bodies
    bfile = tmp / f"bodies-{abs(hash(tuple(bodies)))}.json"
    bfile.write_text(json.dumps([b.decode() for b in bodies]))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_load",
        "--url",
        url + "/v1/chat/completions",
        "--bodies",
        str(bfile),
        "--conc",
        str(conc),
        "--duration",
        str(duration),
    ]
    p = subprocess.Popen(
        pinned(cmd, core),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_affinity(core),
    )
    if background:
        return p
    return collect_pyload(p, duration)


def collect_pyload(p: subprocess.Popen, duration: float) -> dict:
    out, err = p.communicate(timeout=duration + 120)
    for line in out.splitlines():
        if line.startswith("LOADJSON "):
            return json.loads(line[9:])
    raise RuntimeError(f"load generator gave no result: {out[-500:]} {err[-1500:]}")


async def _load_main(url: str, bodies: list[bytes], conc: int, duration: float) -> dict:
    import aiohttp

    lat: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration
    counter = 0
    conn = aiohttp.TCPConnector(limit=conc, force_close=False)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def worker() -> None:
            nonlocal errors, counter
            while time.perf_counter() < stop_at:
                body = bodies[counter % len(bodies)]
                counter += 1
                t0 = time.perf_counter()
                try:
                    async with session.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        elapsed = time.perf_counter() - t_start
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1000 if lat else float("nan")

    return {
        "requests": len(lat),
        "rps": len(lat) / elapsed,
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "mean_ms": sum(lat) / len(lat) * 1000 if lat else float("nan"),
        "max_ms": lat[-1] * 1000 if lat else float("nan"),
        "errors": errors,
        "error_detail": {"failed": errors} if errors else {},
    }


def load_cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--bodies", required=True)
    ap.add_argument("--conc", type=int, required=True)
    ap.add_argument("--duration", type=float, required=True)
    a = ap.parse_args(argv)
    bodies = [b.encode() for b in json.loads(Path(a.bodies).read_text())]
    try:
        import uvloop

        res = uvloop.run(_load_main(a.url, bodies, a.conc, a.duration))
    except ImportError:
        res = asyncio.run(_load_main(a.url, bodies, a.conc, a.duration))
    print("LOADJSON " + json.dumps(res), flush=True)


# ---- the servers under test ------------------------------------------------------------------
def gateway_cli(argv: list[str]) -> None:
    """Serve our gateway (one uvicorn worker) in front of ``--upstream``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    import uvicorn

    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    config = GatewayConfig(host="127.0.0.1", port=a.port, nodes=[a.upstream])
    uvicorn.run(
        create_gateway_app(config),
        host="127.0.0.1",
        port=a.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


def ensure_litellm(venv: Path, log: list[str]) -> tuple[Path | None, str]:
    """The LiteLLM proxy's executable in its own virtualenv, installing it there if needed."""
    exe = venv / "bin" / "litellm"
    py = venv / "bin" / "python"
    if not exe.is_file():
        print(f"installing litellm[proxy] into {venv.relative_to(ROOT)} (first run only) ...")
        try:
            if not py.is_file():
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            r = subprocess.run(
                [str(py), "-m", "pip", "install", "-q", "litellm[proxy]"],
                capture_output=True,
                text=True,
                timeout=1800,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"could not install LiteLLM: {exc!r}"
        if r.returncode != 0 or not exe.is_file():
            tail = (r.stderr or r.stdout)[-800:]
            return None, f"pip install 'litellm[proxy]' failed: {tail}"
    ver = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    log.append(f"litellm {ver}")
    return exe, ver


def litellm_config(upstream: str, path: Path) -> None:
    path.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL_ALIAS}\n"
        "    litellm_params:\n"
        "      model: openai/smollm2-135m-instruct\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: not-needed\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
    )


# ---- the run ---------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    url: str
    proc: Proc | None  # None: the upstream itself
    info: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def started(target: Target) -> Iterator[Target]:
    try:
        yield target
    finally:
        if target.proc is not None:
            target.proc.stop()


def scenarios(concs: list[int]) -> list[tuple[str, int]]:
    return [(mode, c) for mode in ("json", "stream") for c in concs]


def measure(
    target: Target,
    concs: list[int],
    args: argparse.Namespace,
    cores: Cores,
    tmp: Path,
    use_wrk: bool,
) -> list[dict]:
    rows = []
    core = cores.load_direct if target.proc is None else cores.load
    for mode, c in scenarios(concs):
        stream = mode == "stream"
        body = chat_body(SHORT_PROMPT, stream)
        problem = check_reply(target.url, body, stream, args.chunks)
        if problem:
            print(f"  {target.name} {mode} c={c}: WRONG REPLY: {problem}")
            rows.append({"target": target.name, "mode": mode, "c": c, "error": problem})
            continue
        gen = run_wrk if use_wrk else run_pyload
        gen(target.url, body, c, args.warmup, core, tmp)  # warm-up, not recorded
        r = gen(target.url, body, c, args.duration, core, tmp)
        row = {"target": target.name, "mode": mode, "c": c, **r}
        print(
            f"  {target.name:8s} {mode:6s} c={c:<3d} p50 {r['p50_ms']:8.2f} ms  "
            f"p99 {r['p99_ms']:8.2f} ms  {r['rps']:9.1f} req/s  errors {r['errors']}"
        )
        rows.append(row)
    return rows


def long_prompt_scenario(
    target: Target, args: argparse.Namespace, cores: Cores, tmp: Path, use_wrk: bool
) -> dict:
    """Short requests at c=16 alone, then while another client keeps sending long prompts."""
    text, n_tokens = long_prompt(args.long_tokens)
    long_bodies = [chat_body(f"({i}) {text}", False) for i in range(32)]
    problem = check_reply(target.url, long_bodies[0], False, args.chunks)
    if problem:
        return {"error": f"long prompt: {problem}"}
    short = chat_body(SHORT_PROMPT, False)
    gen = run_wrk if use_wrk else run_pyload
    gen(target.url, short, 16, args.warmup, cores.load, tmp)
    alone = gen(target.url, short, 16, args.duration, cores.load, tmp)
    bg = run_pyload(
        target.url, long_bodies, args.long_conc, args.duration + 2, cores.load, tmp, True
    )
    time.sleep(1.0)  # let the long-prompt client get going
    mixed = gen(target.url, short, 16, args.duration, cores.load, tmp)
    longs = collect_pyload(bg, args.duration + 2)  # type: ignore[arg-type]

    # what one long prompt costs to profile (render + tokenize + hash) in this process
    from routing.blocks import block_hashes, model_seed
    from routing.model_store import DEFAULT_MODEL, resolve
    from routing.prompt import PromptFormatter

    info = resolve(DEFAULT_MODEL)
    fmt = PromptFormatter.from_folder(info.path)
    msgs = [{"role": "user", "content": text}]
    fmt.encode_chat(msgs)
    t0 = time.perf_counter()
    for _ in range(5):
        block_hashes(fmt.encode_chat(msgs), model_seed(info.identity))
    profile_ms = (time.perf_counter() - t0) / 5 * 1000
    out = {
        "long_prompt_tokens": n_tokens,
        "long_clients": args.long_conc,
        "profile_ms_per_long_prompt": profile_ms,
        "short_alone": alone,
        "short_with_long": mixed,
        "long": longs,
    }
    print(
        f"  long prompts ({n_tokens} tokens, {longs['rps']:.1f}/s, profiling one takes "
        f"{profile_ms:.1f} ms): short c=16 p50 {alone['p50_ms']:.2f} -> {mixed['p50_ms']:.2f} ms, "
        f"p99 {alone['p99_ms']:.2f} -> {mixed['p99_ms']:.2f} ms"
    )
    return out


def added(rows: list[dict]) -> None:
    direct = {(r["mode"], r["c"]): r for r in rows if r["target"] == "direct" and "p50_ms" in r}
    for r in rows:
        d = direct.get((r["mode"], r["c"]))
        if d is not None and "p50_ms" in r:
            r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"]


def check_targets(rows: list[dict]) -> list[dict]:
    by = {(r["target"], r["mode"], r["c"]): r for r in rows if "p50_ms" in r}
    checks = []
    for (t, mode, c), r in sorted(by.items()):
        if t != "gateway" or "added_p50_ms" not in r:
            continue
        if c == 1:
            checks.append(
                {
                    "scenario": f"{mode} c=1",
                    "target": "added p50 < 1 ms",
                    "value": f"{r['added_p50_ms']:.2f} ms",
                    "ok": r["added_p50_ms"] < 1.0,
                }
            )
            checks.append(
                {
                    "scenario": f"{mode} c=1",
                    "target": "added p99 < 3 ms",
                    "value": f"{r['added_p99_ms']:.2f} ms",
                    "ok": r["added_p99_ms"] < 3.0,
                }
            )
            continue
        lite = by.get(("litellm", mode, c))
        if lite is None or "added_p99_ms" not in lite:
            continue
        ratio = r["rps"] / lite["rps"] if lite["rps"] else float("inf")
        checks.append(
            {
                "scenario": f"{mode} c={c}",
                "target": ">= 15x LiteLLM req/s",
                "value": f"{ratio:.1f}x",
                "ok": ratio >= 15,
            }
        )
        frac = r["added_p99_ms"] / lite["added_p99_ms"] if lite["added_p99_ms"] > 0 else 0.0
        checks.append(
            {
                "scenario": f"{mode} c={c}",
                "target": "added p99 <= 1/10 of LiteLLM's",
                "value": f"{frac:.3f}",
                "ok": frac <= 0.1,
            }
        )
    return checks


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_load"]:
        return load_cli(argv[1:])
    if argv[:1] == ["_gateway"]:
        return gateway_cli(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per scenario")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--chunks", type=int, default=64, help="chunks per streamed reply")
    ap.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    ap.add_argument("--no-long", action="store_true", help="skip the long-prompt scenario")
    ap.add_argument("--long-tokens", type=int, default=5000)
    ap.add_argument("--long-conc", type=int, default=1, help="clients sending long prompts")
    ap.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    ap.add_argument("--litellm-venv", type=Path, default=LITELLM_VENV)
    args = ap.parse_args(argv)
    concs = [int(c) for c in args.concurrency.split(",")]
    use_wrk = args.loadgen == "wrk" or (args.loadgen == "auto" and shutil.which("wrk"))
    cores = Cores.plan()
    notes: list[str] = [cores.note, f"load generator: {'wrk' if use_wrk else 'aiohttp client'}"]
    print("\n".join(notes))

    rows: list[dict] = []
    long_result: dict[str, Any] | None = None
    litellm_status = "skipped (--no-litellm)"
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmpname:
        tmp = Path(tmpname)
        up_port = free_port()
        upstream = Proc(
            "upstream",
            [
                sys.executable,
                str(ROOT / "bench" / "fake_upstream.py"),
                "--port",
                str(up_port),
                "--chunks",
                str(args.chunks),
            ],
            cores.upstream,
            tmp,
        )
        up_url = f"http://127.0.0.1:{up_port}"
        try:
            wait_ready(upstream, up_url, "/health", 30)
            direct = Target("direct", up_url, None)
            print("direct to the upstream")
            rows += measure(direct, concs, args, cores, tmp, use_wrk)

            # our gateway; its tokenizer cache in a fresh home, so the fetch path runs too
            gw_port = free_port()
            env = {**os.environ, "EDGECLOUD_HOME": str(tmp / "gw-home")}
            env.pop("EDGECLOUD_POLICY", None)
            gw = Proc(
                "gateway",
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "_gateway",
                    "--upstream",
                    up_url,
                    "--port",
                    str(gw_port),
                ],
                cores.server,
                tmp,
                env=env,
            )
            with started(Target("gateway", f"http://127.0.0.1:{gw_port}", gw)) as t:
                wait_ready(gw, t.url, "/health", 60)
                print("through our gateway")
                rows += measure(t, concs, args, cores, tmp, use_wrk)
                if not args.no_long:
                    long_result = long_prompt_scenario(t, args, cores, tmp, use_wrk)

            if not args.no_litellm:
                exe, ver = ensure_litellm(args.litellm_venv, notes)
                if exe is None:
                    litellm_status = f"not measured: {ver}"
                    print(litellm_status)
                else:
                    litellm_status = f"litellm {ver}, one worker"
                    cfg = tmp / "litellm.yaml"
                    litellm_config(up_url, cfg)
                    lp = free_port()
                    lenv = {
                        **os.environ,
                        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                        "LITELLM_LOG": "ERROR",
                        "LITELLM_TELEMETRY": "False",
                    }
                    lenv.pop("VIRTUAL_ENV", None)
                    proc = Proc(
                        "litellm",
                        [
                            str(exe),
                            "--config",
                            str(cfg),
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(lp),
                            "--num_workers",
                            "1",
                        ],
                        cores.server,
                        tmp,
                        env=lenv,
                    )
                    with started(Target("litellm", f"http://127.0.0.1:{lp}", proc)) as t:
                        wait_ready(proc, t.url, "/health/liveliness", 180)
                        print(f"through the LiteLLM proxy ({ver})")
                        rows += measure(t, concs, args, cores, tmp, use_wrk)
        finally:
            upstream.stop()

    added(rows)
    checks = check_targets(rows)
    payload = {
        "machine": machine(),
        "cores": notes,
        "chunks": args.chunks,
        "duration_s": args.duration,
        "litellm": litellm_status,
        "rows": rows,
        "long_prompt": long_result,
        "targets": checks,
    }
    write_results("gateway_overhead", payload, render(payload))


def render(p: dict) -> str:
    cols = [
        "mode",
        "c",
        "target",
        "p50_ms",
        "p99_ms",
        "added_p50_ms",
        "added_p99_ms",
        "rps",
        "errors",
    ]
    rows = sorted(
        (r for r in p["rows"] if "p50_ms" in r),
        key=lambda r: (r["mode"], r["c"], ["direct", "gateway", "litellm"].index(r["target"])),
    )
    fmt_rows = [{**r, "rps": round(r["rps"])} for r in rows]
    m = p["machine"]
    lines = [
        "# Gateway overhead: direct vs our gateway vs LiteLLM",
        "",
        f"{m['date']}, {m['cpus']} CPUs, Python {m['python']}. {'; '.join(p['cores'])}.",
        f"Fake upstream (bench/fake_upstream.py), streams of {p['chunks']} chunks + usage; "
        f"{p['duration_s']:.0f} s per measurement after a warm-up. LiteLLM: {p['litellm']}.",
        "Latency is to the last byte of the reply; added = relay minus direct at the same load.",
        "",
        table(fmt_rows, cols),
    ]
    bad = [r for r in p["rows"] if "error" in r]
    if bad:
        lines += ["", "Scenarios that returned a wrong reply:"]
        lines += [f"- {r['target']} {r['mode']} c={r['c']}: {r['error']}" for r in bad]
    if p["targets"]:
        lines += ["", "## Targets (one gateway worker)", ""]
        lines.append(
            table(
                [{**c, "ok": "yes" if c["ok"] else "NO"} for c in p["targets"]],
                ["scenario", "target", "value", "ok"],
            )
        )
    lp = p.get("long_prompt")
    if lp and "error" not in lp:
        a, w, lg = lp["short_alone"], lp["short_with_long"], lp["long"]
        lines += [
            "",
            "## Long prompts do not stall the event loop",
            "",
            f"Short requests at c=16 through the gateway, alone and while {lp['long_clients']} "
            f"other client(s) kept sending {lp['long_prompt_tokens']}-token prompts "
            f"({lg['rps']:.1f} long requests/s, long p50 {lg['p50_ms']:.1f} ms). Profiling one "
            f"long prompt (render, tokenize, hash) takes {lp['profile_ms_per_long_prompt']:.1f} "
            "ms of CPU.",
            "",
            table(
                [
                    {"short requests": "alone", **a, "rps": round(a["rps"])},
                    {"short requests": "with long prompts", **w, "rps": round(w["rps"])},
                ],
                ["short requests", "p50_ms", "p90_ms", "p99_ms", "max_ms", "rps", "errors"],
            ),
        ]
    elif lp:
        lines += ["", f"Long-prompt scenario failed: {lp['error']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
