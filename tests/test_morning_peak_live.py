"""bench/morning_peak_live.py: its level schedule, its latency proxy over loopback HTTP, and
(slow) the whole pipeline in its ``--smoke`` mode."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench._peak_live_proxy import Route, start
from bench._peak_live_schedule import Level, level_trace, parse_window, schedule
from routing.sim.trace import TraceRequest

ROOT = Path(__file__).resolve().parents[1]


def test_schedule_windows_and_rates() -> None:
    levels = schedule("09:10-09:12", [1, 2, 4, 8])
    assert [(lv.start_s, lv.end_s) for lv in levels] == [
        (4200.0, 4320.0),
        (4320.0, 4440.0),
        (4440.0, 4560.0),
        (4560.0, 4680.0),
    ]
    assert [lv.duration_s for lv in levels] == [120.0, 60.0, 30.0, 15.0]
    assert levels[2].label == "4x 09:14-09:16"
    # past the plateau's end a level wraps to its start
    wrap = schedule("09:20-09:30", [1, 2])
    assert (wrap[1].start_s, wrap[1].end_s) == parse_window("09:00-09:10")
    with pytest.raises(ValueError):
        schedule("09:00-09:40", [1])


def test_level_trace_compresses_arrivals() -> None:
    reqs = [
        TraceRequest(arrival_s=t, prompt_tokens=10, output_tokens=5, region="eu-north")
        for t in (4199.0, 4200.0, 4260.0, 4319.0, 4320.0)
    ]
    out = level_trace(reqs, Level(4.0, 4200.0, 4320.0), "eu-west")
    assert [r.arrival_s for r in out] == [0.0, 15.0, 29.75]
    assert {r.region for r in out} == {"eu-west"}


def test_proxy_adds_round_trip_over_http() -> None:
    """A real HTTP request through the proxy takes the route's round trip more than direct."""
    import httpx
    from aiohttp import web

    async def run() -> tuple[float, float]:
        app = web.Application()
        app.router.add_get("/x", lambda _: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        servers = await start([Route(0, port, 120.0)])
        pport = servers[0].sockets[0].getsockname()[1]
        times = {}
        async with httpx.AsyncClient() as c:
            for name, p in (("direct", port), ("proxy", pport)):
                await c.get(f"http://127.0.0.1:{p}/x")  # connection set up
                t0 = time.perf_counter()
                r = await c.get(f"http://127.0.0.1:{p}/x")
                times[name] = time.perf_counter() - t0
                assert r.text == "ok"
        for s in servers:
            s.close()
        await runner.cleanup()
        return times["direct"], times["proxy"]

    direct, proxied = asyncio.run(run())
    assert 0.115 <= proxied - direct < 0.25


@pytest.mark.slow
def test_smoke_run(tmp_path: Path) -> None:
    """The whole pipeline on the CPU with tiny models: nothing lost, every class has live and
    simulated figures at every level."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/morning_peak_live.py", "--smoke"]
    cmd += ["--models-dir", str(tmp_path / "models"), "--home", str(tmp_path / "home")]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    data = json.loads((ROOT / "bench/results/raw/morning_peak_live_smoke.json").read_text())
    assert data["requests_lost"] == 0
    assert len(data["levels"]) == 2
    for lv in data["levels"]:
        assert lv["requests"] > 0
        for cls in ("chat", "code", "automation", "all"):
            assert lv["live"][cls]["n"] > 0
            assert lv["live"][cls]["mean_e2e"] > 0
            assert lv["sim"][cls]["mean_e2e"] > 0
            assert lv["live"][cls]["p99_ttft"] >= lv["live"][cls]["p50_ttft"]
    assert {g["goal"] for g in data["goals"]} >= {"requests lost == 0", "TTFT p99 < 1.0 s"}
