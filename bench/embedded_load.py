"""The embedded default under load on this CPU: ``edgecloud serve`` against its own edge node
alone on the same cores and against llama.cpp's ``llama-server`` on the same model.

Closed loop: ``U`` users each send a streamed chat request (a prompt of new random words,
about ``--prompt-words`` of them; ``--max-tokens`` answer tokens, the end-of-sequence token
ignored so every system writes the same number), wait for its last byte, and send the next,
for ``--duration`` seconds per level. Every system runs every level in turn; ``--rounds``
alternate the systems' order. Per system and level: requests, mean, p50 and p99 end-to-end
and TTFT, output tok/s (answer tokens over the level's wall time), failures.

Systems (each on the same cores, all of them):
- ``serve``: ``edgecloud serve`` as the README starts it (model ``auto``), and with each
  ``--serve-flags`` (another sizing of its nodes);
- ``edge``: the edge node alone (``edgecloud edge serve``), all cores, ``--edge-slots`` slots,
  the variant the quality gate picks, and with each ``--edge-flags``;
- ``llama-server Q4_0`` and ``Q8_0`` (where ``scripts/setup_llama_cpp.sh`` built them): 16
  parallel slots, continuous batching, all cores; the GGUFs descend from the same Q4_1 weights.

    python bench/embedded_load.py [--users 1 4 16 32] [--duration 60] [--rounds 2]

Writes bench/results/embedded_load.json and .md and prints a table; per-request rows go to
bench/results/raw/embedded_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import edge_peer_llama as llama
from bench._common import machine, recorded_command, table, write_results
from bench._serve import embedded_default, free_port_block, stop_group
from bench.edge_shared_prompt import WORDS
from gateway.node_token import NODE_TOKEN_HEADER

MODEL = "smollm2-135m-instruct"
PEER_SLOTS = 16


@dataclass(frozen=True)
class Target:
    """A running system: where to send chat requests, the model name and headers it wants."""

    name: str
    url: str
    model: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Reply:
    system: str
    users: int
    round: int
    ok: bool
    e2e_s: float
    ttft_s: float
    tokens: int
    error: str = ""


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float, headers: dict) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0, headers=headers).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.5)


@contextlib.contextmanager
def _process(cmd: list[str], url: str, env: dict[str, str], headers: dict) -> Iterator[None]:
    """``cmd`` in its own process group until the block ends; up once ``/health`` says 200."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            _wait_up(url, proc, 300.0, headers)
            yield
        finally:
            stop_group(proc)


@contextlib.contextmanager
def start(system: str, args: argparse.Namespace) -> Iterator[Target]:
    """Run ``system`` for the block's length."""
    cores = os.cpu_count() or 2
    if system.startswith("serve"):
        flags = system.removeprefix("serve").split()  # "serve --edge-slots 16": those flags
        if "--cloud-device" not in flags:  # serve's own default, as the README starts it
            flags += ["--cloud-device", "auto"]
        with embedded_default(flags) as base:
            yield Target(system, base, "auto", {})
        return
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    if system.startswith("edge"):
        token = secrets.token_urlsafe(16)
        headers = {NODE_TOKEN_HEADER: token}
        exe = Path(sys.executable).with_name("edgecloud")
        cmd = [str(exe), "edge", "serve", "--port", str(port), "--threads", str(cores),
               "--slots", str(args.edge_slots), *system.removeprefix("edge").split()]  # fmt: skip
        env = {**os.environ, "EDGECLOUD_NODE_TOKEN": token}
        with _process(cmd, url, env, headers):
            yield Target(system, url, MODEL, headers)
        return
    quant = system.split()[-1]
    gguf = llama.gguf_path(_identity(), quant)
    ctx = PEER_SLOTS * (args.prompt_words * 2 + args.max_tokens + 64)
    cmd = [str(llama.binary("llama-server")), "-m", str(gguf), "--port", str(port),
           "-t", str(cores), "-tb", str(cores), "-np", str(PEER_SLOTS), "-c", str(ctx),
           "--cont-batching", "--no-webui"]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(llama.binary("llama-server").parent)}
    with _process(cmd, url, env, {}):
        yield Target(system, url, MODEL, {})


def _identity() -> str:
    from routing.model_store import resolve

    return resolve(MODEL).identity


def systems(args: argparse.Namespace) -> list[str]:
    """``serve``, ``edge`` and the llama-server quantizations that are built here."""
    out = ["serve", *(f"serve {f}" for f in args.serve_flags), "edge"]
    out += [f"edge {f}" for f in args.edge_flags]
    if llama.binary("llama-server").is_file():
        out += [f"llama-server {q}" for q in ("Q4_0", "Q8_0") if q in llama.available(_identity())]
    else:
        print("llama-server is not built (scripts/setup_llama_cpp.sh): no peer", file=sys.stderr)
    return [s for s in out if not args.only or s in args.only]


async def _one(
    client: httpx.AsyncClient, t: Target, prompt: str, args: argparse.Namespace
) -> tuple[bool, float, float, int, str]:
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, tokens, chunks = 0.0, 0, 0
    try:
        async with client.stream("POST", t.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return False, time.perf_counter() - t0, 0.0, 0, f"HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    tokens = int(data["usage"].get("completion_tokens") or 0)
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if not ttft:
                            ttft = time.perf_counter() - t0
    except httpx.HTTPError as e:
        return False, time.perf_counter() - t0, ttft, 0, type(e).__name__
    return True, time.perf_counter() - t0, ttft, tokens or chunks, ""


async def level(
    t: Target, users: int, rnd: int, args: argparse.Namespace
) -> tuple[list[Reply], float]:
    """``users`` closed-loop users for ``args.duration`` seconds: every reply they got, and
    the level's wall time (to the last reply's end)."""
    rng = random.Random(f"{t.name}/{users}/{rnd}/{args.seed}")
    replies: list[Reply] = []
    end = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=users + 4)
    async with httpx.AsyncClient(timeout=600.0, headers=t.headers, limits=limits) as client:

        async def user() -> None:
            while time.monotonic() < end:
                prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                ok, e2e, ttft, tokens, err = await _one(client, t, prompt, args)
                replies.append(Reply(t.name, users, rnd, ok, e2e, ttft, tokens, err))

        t0 = time.monotonic()
        await asyncio.gather(*(user() for _ in range(users)))
        wall = time.monotonic() - t0
    return replies, wall


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(replies: list[Reply], walls: dict[tuple[str, int, int], float]) -> list[dict]:
    rows = []
    keys = sorted({(r.system, r.users) for r in replies}, key=lambda k: (k[1], k[0]))
    for system, users in keys:
        mine = [r for r in replies if (r.system, r.users) == (system, users)]
        ok = [r for r in mine if r.ok]
        e2e = [r.e2e_s for r in ok]
        wall = sum(w for (s, u, _), w in walls.items() if (s, u) == (system, users))
        rows.append({
            "users": users,
            "system": system,
            "requests": len(ok),
            "failed": len(mine) - len(ok),
            "mean e2e s": round(statistics.fmean(e2e), 2) if e2e else None,
            "p50 e2e s": round(_pct(e2e, 0.5), 2),
            "p99 e2e s": round(_pct(e2e, 0.99), 2),
            "mean TTFT s": round(statistics.fmean([r.ttft_s for r in ok]), 2) if ok else None,
            "output tok/s": round(sum(r.tokens for r in ok) / wall, 1) if wall else None,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per level")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-words", type=int, default=60, help="about 80 prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--edge-slots", type=int, default=16, help="the lone edge node's slots")
    ap.add_argument(
        "--serve-flags",
        action="append",
        default=[],
        metavar="FLAGS",
        help="also run 'edgecloud serve FLAGS' (a sizing to compare; repeatable)",
    )
    ap.add_argument(
        "--edge-flags",
        action="append",
        default=[],
        metavar="FLAGS",
        help="also run the lone edge node with FLAGS (e.g. '--variant fp32'; repeatable)",
    )
    ap.add_argument("--only", nargs="+", help="run only these systems")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = systems(args)
    replies: list[Reply] = []
    walls: dict[tuple[str, int, int], float] = {}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            with start(name, args) as target:
                warm = argparse.Namespace(**{**vars(args), "duration": 3.0})
                asyncio.run(level(target, 1, -1, warm))  # the first requests are not measured
                for users in args.users:
                    got, walls[name, users, rnd] = asyncio.run(level(target, users, rnd, args))
                    replies += got
                    print(f"round {rnd} {name} {users} users: {len(got)} replies", flush=True)
    rows = summarize(replies, walls)
    command = recorded_command("embedded_load.py", sys.argv[1:] if argv is None else argv, ())
    from edge_runtime.quality_gate import cpu_signature

    info = {**machine(), "cpu": cpu_signature()}
    md = "\n\n".join([
        "# embedded_load: the embedded default under load, against its edge alone and llama-server",
        f"`{command}`",
        f"CPU: {info.get('cpu')}; llama.cpp build {llama.version()}; {args.rounds} round(s) of "
        f"{args.duration:g} s per level, closed loop, ~{args.prompt_words} prompt words, "
        f"{args.max_tokens} answer tokens (end of sequence ignored).",
        table(rows, list(rows[0])),
    ])  # fmt: skip
    write_results(
        "embedded_load",
        {"command": command, "machine": info, "rows": rows},
        md,
        raw={"replies": [asdict(r) for r in replies]},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
