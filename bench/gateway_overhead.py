"""What the gateway adds to a request: direct vs through our gateway vs through the LiteLLM proxy.

One fast fake upstream (``bench/fake_upstream.py``, its own process pinned to one core) and the
same load sent to it (a) directly, (b) through our gateway (one uvicorn worker with uvloop and
httptools, in-process fleet store polling the upstream's ``/load``, routing fully on: the prompt
is rendered, tokenized and block-hashed, the fleet read, a decision made) and (c) through the
LiteLLM proxy (installed by this script in its own virtualenv under ``.cache/``, one worker).
Also our gateway sending to its nodes through httpx's transport instead of its own HTTP/1.1
client (``gateway-httpx``, the other transport of ``gateway.front.node_client``; ``--no-httpx``
skips it): the comparison that keeps ``gateway/front/http1_*.py``. Loads: concurrency 1, 16 and
64, non-streaming and streaming (64 chunks). Reported per scenario:
p50/p99 latency, the p50/p99 added over direct, requests/s, and the CPU time the server under
test spent per request. Every request carries one API key (LiteLLM needs a master key; our
gateway is given the same key, so both authenticate).

Long prompts: short requests at concurrency 16 through the gateway, alone and while another
client keeps sending ~5,000-token prompts; then the same with a gateway forced to tokenize on
its event loop, for comparison.

The load generator is ``wrk`` (with a Lua script) when installed, else an aiohttp client in its
own process; it never shares a core with the server under test. Cores, with N available:
server under test on core 0, upstream on core 1, load on core 2 (N >= 3); with 2 cores the load
shares core 1 with the upstream, except for the direct runs (load on core 0). A server that
stopped receiving load is waited for until idle before the next run.

    python bench/gateway_overhead.py [--duration 8] [--repeat 3] [--concurrency 1,16,64]
        [--no-litellm] [--no-httpx] [--no-long] [--compare-loop] [--loadgen wrk|python]
    python bench/gateway_overhead.py _render     # rewrite the markdown from the JSON

Results: bench/results/gateway_overhead.{json,md}.

Workers (``bench/gateway_workers.py``): req/s and added latency through ``edgecloud gateway
--workers N`` for each N, the ratio to one worker being the result:

    python bench/gateway_overhead.py --workers 1,2,4,8 [--duration 8] [--workers-conc 256]
        [--upstream-cores 4] [--load-cores 4]
    python bench/gateway_overhead.py _render_workers

Results: bench/results/gateway_workers.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, machine, table, write_results

ROOT = Path(__file__).resolve().parents[1]
# One API key for the run, sent to every target (LiteLLM refuses to start without a master key;
# our gateway is configured with the same key, so both do their authentication work).
BENCH_KEY = os.environ.setdefault("BENCH_KEY", "sk-bench-" + secrets.token_hex(16))
JSON = {"Content-Type": "application/json"}


def auth_header() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ['BENCH_KEY']}"}


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
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
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
        conn.request("POST", path, body, {**JSON, **auth_header()})
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


async def _load_main(
    url: str, bodies: list[bytes], conc: int, duration: float, raw: Path | None = None
) -> dict:
    """``conc`` connections sending ``bodies`` in turn for ``duration`` s; ``raw``: also
    write every latency (seconds, sorted) there as JSON (to merge several generators)."""
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
                    async with session.post(url, data=body, headers={**JSON, **auth_header()}) as r:
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
    if raw is not None:
        raw.write_text(json.dumps(lat))

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
    ap.add_argument("--raw", type=Path, default=None, help="write every latency here (JSON)")
    a = ap.parse_args(argv)
    bodies = [b.encode() for b in json.loads(Path(a.bodies).read_text())]
    try:
        import uvloop

        res = uvloop.run(_load_main(a.url, bodies, a.conc, a.duration, a.raw))
    except ImportError:
        res = asyncio.run(_load_main(a.url, bodies, a.conc, a.duration, a.raw))
    print("LOADJSON " + json.dumps(res), flush=True)


# ---- the servers under test ------------------------------------------------------------------
def gateway_cli(argv: list[str]) -> None:
    """Serve our gateway (one uvicorn worker) in front of ``--upstream``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--inline-tokenize", action="store_true")
    ap.add_argument("--loop", default="uvloop", choices=["uvloop", "asyncio"])
    ap.add_argument("--transport", default="h1", choices=["h1", "httpx"])
    a = ap.parse_args(argv)
    import uvicorn

    from gateway.auth import AuthConfig, hash_key
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    salt = secrets.token_hex(16)
    auth = AuthConfig(
        salt=salt, keys=[{"name": "bench", "key_hash": hash_key(os.environ["BENCH_KEY"], salt)}]
    )
    config = GatewayConfig(host="127.0.0.1", port=a.port, nodes=[a.upstream], auth=auth)
    if a.inline_tokenize:  # for comparison only: tokenize every prompt on the event loop
        import gateway.front.request_path as path_module

        path_module._OFFLOAD_CHARS = 1 << 62
    if a.transport == "httpx":  # for comparison only: every node POST through httpx
        import gateway.front.node_client as client_module

        client_module.default_transport = lambda fallback, *_: fallback
    uvicorn.run(
        create_gateway_app(config),
        host="127.0.0.1",
        port=a.port,
        loop=a.loop,
        http="httptools",
        access_log=False,
        log_level="warning",
        proxy_headers=False,  # as `edgecloud gateway` runs it (the gateway reads XFF itself)
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
        "general_settings:\n"
        "  master_key: os.environ/BENCH_KEY\n"
    )


# ---- the run ---------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    url: str
    proc: Proc | None  # None: the upstream itself
    cpu_pid: int  # whose CPU time counts as the server's


@contextlib.contextmanager
def started(target: Target) -> Iterator[Target]:
    try:
        yield target
    finally:
        if target.proc is not None:
            target.proc.stop()


def scenarios(concs: list[int]) -> list[tuple[str, int]]:
    return [(mode, c) for mode in ("json", "stream") for c in concs]


def proc_cpu(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants (0 where /proc cannot tell)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu seconds)
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            stats[int(d.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        cur = todo.pop()
        total += stats.get(cur, (0, 0.0))[1]
        todo.extend(k for k, (pp, _) in stats.items() if pp == cur)
    return total


@dataclass
class Loader:
    """Runs one load (wrk or the aiohttp client) and measures the server's CPU meanwhile."""

    use_wrk: bool
    tmp: Path

    def run(
        self, url: str, body: bytes, conc: int, duration: float, core: int | None, cpu_pid: int
    ) -> dict:
        cpu0 = proc_cpu(cpu_pid)
        if self.use_wrk:
            r = run_wrk(url, body, conc, duration, core, self.tmp)
        else:
            r = run_pyload(url, body, conc, duration, core, self.tmp)
        assert isinstance(r, dict)
        r["cpu_us_per_req"] = (proc_cpu(cpu_pid) - cpu0) / max(1, r["requests"]) * 1e6
        return r


MEDIAN_KEYS = ("rps", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "max_ms", "cpu_us_per_req")


def median_run(runs: list[dict]) -> dict:
    """Per metric, the median over repeated runs; request and error counts are summed."""
    out = {k: statistics.median(r[k] for r in runs) for k in MEDIAN_KEYS}
    out["requests"] = sum(r["requests"] for r in runs)
    out["errors"] = sum(r["errors"] for r in runs)
    details = [r["error_detail"] for r in runs if r["error_detail"]]
    out["error_detail"] = details
    if len(runs) > 1:
        out["runs"] = [{k: r[k] for k in (*MEDIAN_KEYS, "errors")} for r in runs]
    return out


def wait_idle(pid: int, timeout: float = 60.0) -> None:
    """Until the server is idle (under 5% of a core over 0.5 s): a load generator that stopped
    leaves requests the server may still be working on, which must not count in the next run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c0 = proc_cpu(pid)
        time.sleep(0.5)
        if proc_cpu(pid) - c0 < 0.025:
            return


def measure(
    target: Target, concs: list[int], args: argparse.Namespace, cores: Cores, load: Loader
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
        warm = load.run(target.url, body, c, args.warmup, core, target.cpu_pid)
        wait_idle(target.cpu_pid)
        # a slow server gets longer runs, so that every connection completes a few requests
        duration = args.duration
        if warm["rps"] * duration < 4 * c:
            duration = min(args.max_duration, 4 * c / max(warm["rps"], 1e-3))
        runs = []
        for _ in range(args.repeat):
            runs.append(load.run(target.url, body, c, duration, core, target.cpu_pid))
            wait_idle(target.cpu_pid)
        done = [r for r in runs if r["requests"]]
        if not done:
            problem = f"no request completed in {duration:.0f} s"
            print(f"  {target.name} {mode} c={c}: {problem}")
            rows.append({"target": target.name, "mode": mode, "c": c, "error": problem})
            continue
        r = median_run(done)
        row = {"target": target.name, "mode": mode, "c": c, "duration_s": duration, **r}
        print(
            f"  {target.name:15s} {mode:6s} c={c:<3d} p50 {r['p50_ms']:8.2f} ms  "
            f"p99 {r['p99_ms']:8.2f} ms  {r['rps']:8.1f} req/s  "
            f"{r['cpu_us_per_req']:7.0f} us CPU/req  errors {r['errors']}"
        )
        rows.append(row)
    return rows


def long_prompt_scenario(
    target: Target, args: argparse.Namespace, cores: Cores, load: Loader, text: str
) -> dict:
    """Short requests at c=16 alone, then while another client keeps sending long prompts."""
    long_bodies = [chat_body(f"({i}) {text}", False) for i in range(32)]
    problem = check_reply(target.url, long_bodies[0], False, args.chunks)
    if problem:
        return {"error": f"long prompt: {problem}"}
    short = chat_body(SHORT_PROMPT, False)

    def short_load() -> dict:
        runs = [
            load.run(target.url, short, 16, args.duration, cores.load, target.cpu_pid)
            for _ in range(args.repeat)
        ]
        return median_run(runs)

    load.run(target.url, short, 16, args.warmup, cores.load, target.cpu_pid)
    alone = short_load()
    span = args.duration * args.repeat + 3
    bg = run_pyload(target.url, long_bodies, args.long_conc, span, cores.load, load.tmp, True)
    time.sleep(1.0)  # let the long-prompt client get going
    mixed = short_load()
    longs = collect_pyload(bg, span)  # type: ignore[arg-type]
    print(
        f"  {target.name}: long prompts {longs['rps']:.1f}/s (p50 {longs['p50_ms']:.0f} ms); "
        f"short c=16 p50 {alone['p50_ms']:.2f} -> {mixed['p50_ms']:.2f} ms, "
        f"p99 {alone['p99_ms']:.2f} -> {mixed['p99_ms']:.2f} ms"
    )
    return {"short_alone": alone, "short_with_long": mixed, "long": longs}


def profile_cost_ms(text: str) -> float:
    """CPU time to profile one long prompt (render, tokenize, hash), here, in one thread."""
    from routing.blocks import block_hashes, model_seed
    from routing.model_store import DEFAULT_MODEL, resolve
    from routing.prompt import PromptFormatter

    info = resolve(DEFAULT_MODEL)
    fmt = PromptFormatter.from_folder(info.path)
    msgs = [{"role": "user", "content": text}]
    fmt.encode_chat(msgs)
    t0 = time.process_time()
    for _ in range(5):
        block_hashes(fmt.encode_chat(msgs), model_seed(info.identity))
    return (time.process_time() - t0) / 5 * 1000


def added(rows: list[dict]) -> None:
    direct = {(r["mode"], r["c"]): r for r in rows if r["target"] == "direct" and "p50_ms" in r}
    for r in rows:
        d = direct.get((r["mode"], r["c"]))
        if d is not None and "p50_ms" in r:
            r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"]


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets for each gateway row (one worker), against direct and LiteLLM."""
    by = {(r["target"], r["mode"], r["c"]): r for r in rows if "p50_ms" in r}
    checks = []

    def check(r: dict, what: str, value: str, ok: bool | None) -> None:
        scenario = f"{r['mode']} c={r['c']}"
        checks.append({"gateway": r["target"], "scenario": scenario, "target": what})
        checks[-1].update(value=value, ok=ok)

    for (t, mode, c), r in sorted(by.items()):
        if not t.startswith("gateway") or "added_p50_ms" not in r:
            continue
        if c == 1:
            added_p50, added_p99 = r["added_p50_ms"], r["added_p99_ms"]
            check(r, "added p50 < 1 ms", f"{added_p50:.2f} ms", added_p50 < 1.0)
            check(r, "added p99 < 3 ms", f"{added_p99:.2f} ms", added_p99 < 3.0)
            continue
        lite = by.get(("litellm", mode, c))
        if lite is None or "added_p99_ms" not in lite:
            continue
        ratio = r["rps"] / lite["rps"]
        check(r, ">= 15x LiteLLM's req/s", f"{ratio:.1f}x", ratio >= 15)
        cpu = lite["cpu_us_per_req"] / r["cpu_us_per_req"]
        check(r, "(info) LiteLLM's CPU per request / ours", f"{cpu:.1f}x", None)
        if lite["added_p99_ms"] > 0:
            frac = r["added_p99_ms"] / lite["added_p99_ms"]
            value = f"{r['added_p99_ms']:.0f} / {lite['added_p99_ms']:.0f} ms = {frac:.3f}"
            check(r, "added p99 <= 1/10 of LiteLLM's", value, frac <= 0.1)
    return checks


def start_gateway(
    up_url: str,
    cores: Cores,
    tmp: Path,
    name: str,
    loop: str,
    *extra: str,
    transport: str = "h1",
) -> Target:
    """Our gateway in its own process; its tokenizer cache in a fresh home (fetched from the
    upstream on the first request, as in production). ``transport``: ``h1`` (the gateway's
    own HTTP/1.1 client, as it ships) or ``httpx`` (httpx's transport, for comparison)."""
    port = free_port()
    env = {**os.environ, "EDGECLOUD_HOME": str(tmp / f"{name}-home")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "_gateway", "--upstream", up_url]
    cmd += ["--loop", loop, "--transport", transport]
    proc = Proc(name, [*cmd, "--port", str(port), *extra], cores.server, tmp, env=env)
    target = Target(name, f"http://127.0.0.1:{port}", proc, proc.p.pid)
    try:
        wait_ready(proc, target.url, "/health", 60)
    except BaseException:
        proc.stop()
        raise
    return target


def start_litellm(exe: Path, up_url: str, cores: Cores, tmp: Path) -> Target:
    cfg = tmp / "litellm.yaml"
    litellm_config(up_url, cfg)
    port = free_port()
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no network fetch at start
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
    }
    env.pop("VIRTUAL_ENV", None)
    cmd = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    proc = Proc("litellm", [*cmd, "--num_workers", "1"], cores.server, tmp, env=env)
    target = Target("litellm", f"http://127.0.0.1:{port}", proc, proc.p.pid)
    try:
        wait_ready(proc, target.url, "/health/liveliness", 240)
    except BaseException:
        proc.stop()
        raise
    return target


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_load"]:
        return load_cli(argv[1:])
    if argv[:1] == ["_gateway"]:
        return gateway_cli(argv[1:])
    if argv[:1] == ["_render_workers"]:  # the workers sweep's markdown, from its JSON
        from bench.gateway_workers import NAME, render

        payload = json.loads((RESULTS / f"{NAME}.json").read_text())
        return write_results(NAME, payload, render(payload))
    if argv[:1] == ["_render"]:  # rewrite the markdown (and targets) from the JSON results
        payload = json.loads((RESULTS / "gateway_overhead.json").read_text())
        payload["targets"] = check_targets(payload["rows"])
        return write_results("gateway_overhead", payload, render(payload))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per scenario")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario (median reported)")
    ap.add_argument(
        "--max-duration", type=float, default=30.0, help="longest run, for a slow server"
    )
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--chunks", type=int, default=64, help="chunks per streamed reply")
    ap.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    ap.add_argument("--no-long", action="store_true", help="skip the long-prompt scenario")
    ap.add_argument(
        "--name", default="gateway_overhead", help="results file name (partial runs: another)"
    )
    ap.add_argument(
        "--no-httpx",
        action="store_true",
        help="skip the gateway that sends to its nodes through httpx's transport",
    )
    ap.add_argument("--long-tokens", type=int, default=5000)
    ap.add_argument("--long-conc", type=int, default=1, help="clients sending long prompts")
    ap.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto")
    ap.add_argument("--litellm-venv", type=Path, default=LITELLM_VENV)
    ap.add_argument(
        "--gateway-loop", default="uvloop", choices=["uvloop", "asyncio"], help="its event loop"
    )
    ap.add_argument(
        "--compare-loop", action="store_true", help="also measure the gateway on the other loop"
    )
    from bench.gateway_workers import add_arguments, sweep

    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.workers:
        return sweep(args)
    concs = [int(c) for c in args.concurrency.split(",")]
    use_wrk = bool(args.loadgen == "wrk" or (args.loadgen == "auto" and shutil.which("wrk")))
    cores = Cores.plan()
    notes: list[str] = [cores.note, f"load generator: {'wrk' if use_wrk else 'aiohttp client'}"]
    print("\n".join(notes))
    load_before = os.getloadavg()

    rows: list[dict] = []
    long_result: dict[str, Any] | None = None
    litellm_status = "skipped (--no-litellm)"
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmpname:
        tmp = Path(tmpname)
        load = Loader(use_wrk, tmp)
        up_port = free_port()
        fake = [sys.executable, str(ROOT / "bench" / "fake_upstream.py")]
        upstream = Proc(
            "upstream",
            [*fake, "--port", str(up_port), "--chunks", str(args.chunks)],
            cores.upstream,
            tmp,
        )
        up_url = f"http://127.0.0.1:{up_port}"
        try:
            wait_ready(upstream, up_url, "/health", 30)
            print("direct to the upstream")
            rows += measure(
                Target("direct", up_url, None, upstream.p.pid), concs, args, cores, load
            )

            print("through our gateway")
            with started(start_gateway(up_url, cores, tmp, "gateway", args.gateway_loop)) as t:
                rows += measure(t, concs, args, cores, load)
                if not args.no_long:
                    text, n_tokens = long_prompt(args.long_tokens)
                    long_result = {
                        "long_prompt_tokens": n_tokens,
                        "long_clients": args.long_conc,
                        "profile_ms_per_long_prompt": profile_cost_ms(text),
                        "offloaded": long_prompt_scenario(t, args, cores, load, text),
                    }
            if not args.no_httpx:
                print("through our gateway sending to the upstream through httpx's transport")
                with started(
                    start_gateway(
                        up_url, cores, tmp, "gateway-httpx", args.gateway_loop, transport="httpx"
                    )
                ) as t:
                    rows += measure(t, concs, args, cores, load)
            if args.compare_loop:
                other = "asyncio" if args.gateway_loop == "uvloop" else "uvloop"
                print(f"through our gateway on the {other} event loop, for comparison")
                name = f"gateway-{other}"
                with started(start_gateway(up_url, cores, tmp, name, other)) as t:
                    rows += measure(t, concs, args, cores, load)
            if long_result is not None:
                print("for comparison: a gateway that tokenizes every prompt on its event loop")
                with started(
                    start_gateway(
                        up_url, cores, tmp, "gateway-inline", args.gateway_loop, "--inline-tokenize"
                    )
                ) as t:
                    long_result["inline"] = long_prompt_scenario(t, args, cores, load, text)

            if not args.no_litellm:
                exe, ver = ensure_litellm(args.litellm_venv, notes)
                if exe is None:
                    litellm_status = f"not measured: {ver}"
                    print(litellm_status)
                else:
                    litellm_status = f"litellm {ver}, one worker"
                    print(f"through the LiteLLM proxy ({ver})")
                    with started(start_litellm(exe, up_url, cores, tmp)) as t:
                        rows += measure(t, concs, args, cores, load)
        finally:
            upstream.stop()

    added(rows)
    checks = check_targets(rows)
    payload = {
        "machine": machine(),
        "loadavg_before_after": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "cores": notes,
        "chunks": args.chunks,
        "duration_s": args.duration,
        "repeat": args.repeat,
        "gateway_loop": args.gateway_loop,
        "litellm": litellm_status,
        "rows": rows,
        "long_prompt": long_result,
        "targets": checks,
    }
    write_results(args.name, payload, render(payload))


def render(p: dict) -> str:
    cols = ["mode", "c", "target", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms"]
    cols += ["rps", "cpu_us_per_req", "errors"]
    order = ["direct", "gateway", "gateway-httpx", "gateway-asyncio", "gateway-uvloop"]
    order.append("litellm")
    rows = sorted(
        (r for r in p["rows"] if "p50_ms" in r),
        key=lambda r: (r["mode"], r["c"], order.index(r["target"])),
    )
    fmt_rows = [
        {**r, "rps": round(r["rps"]), "cpu_us_per_req": round(r["cpu_us_per_req"])} for r in rows
    ]
    m = p["machine"]
    la = p["loadavg_before_after"]
    lines = [
        "# Gateway overhead: direct vs our gateway vs LiteLLM",
        "",
        f"{m['date']}, {m['cpus']} CPUs, Python {m['python']}; load average before "
        f"{la[0]:.2f} / after {la[3]:.2f} (other work shared the machine). "
        f"{'; '.join(p['cores'])}.",
        "",
        f"Fake upstream (bench/fake_upstream.py): a fixed answer; streams of {p['chunks']} "
        "content chunks + a usage chunk + [DONE], one write per event. "
        f"{p['duration_s']:.0f} s per measurement after a warm-up"
        + (f", median of {p['repeat']} runs" if p["repeat"] > 1 else "")
        + f". Gateway: one uvicorn worker, httptools, {p['gateway_loop']} event loop. "
        f"LiteLLM: {p['litellm']}. Every request carries the same API key; our gateway "
        "checks it, routes with the latency policy (prompt rendered, tokenized, block-hashed; "
        "one fleet view; a decision) and relays.",
        "",
        "Latency is to the last byte of the reply; added = through the relay minus direct at "
        "the same load; cpu_us_per_req = CPU time of the server under test (the upstream for "
        "direct rows) per request, which other work on the machine disturbs less than latency.",
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
                [{**c, "ok": {True: "yes", False: "NO", None: ""}[c["ok"]]} for c in p["targets"]],
                ["gateway", "scenario", "target", "value", "ok"],
            )
        )
    lp = p.get("long_prompt")
    if lp:
        lines += ["", "## Long prompts and the event loop", ""]
        lines.append(
            f"Short requests at c=16 through the gateway, alone and while {lp['long_clients']} "
            f"other client(s) kept sending {lp['long_prompt_tokens']}-token prompts. Profiling "
            f"one such prompt (render, tokenize, hash) takes "
            f"{lp['profile_ms_per_long_prompt']:.1f} ms of CPU. 'offloaded' is the gateway as "
            "it ships (long prompts tokenized in a worker thread, the GIL released while the "
            "tokenizer runs); 'inline' is the same gateway made to tokenize on its event loop, "
            "for comparison."
        )
        table_rows = []
        for variant in ("offloaded", "inline"):
            res = lp.get(variant)
            if not res:
                continue
            if "error" in res:
                lines += ["", f"{variant}: failed: {res['error']}"]
                continue
            lg = res["long"]
            for label, r in (("alone", res["short_alone"]), ("with long", res["short_with_long"])):
                table_rows.append(
                    {
                        "gateway": variant,
                        "short requests": label,
                        **r,
                        "rps": round(r["rps"]),
                        "long req/s": f"{lg['rps']:.1f}" if label != "alone" else "",
                        "long p50_ms": f"{lg['p50_ms']:.0f}" if label != "alone" else "",
                    }
                )
        cols = ["gateway", "short requests", "p50_ms", "p90_ms", "p99_ms", "max_ms", "rps"]
        lines += ["", table(table_rows, [*cols, "errors", "long req/s", "long p50_ms"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
