"""Private Redis deployments as operators run them, from the system's redis-server: a Redis
Cluster of 3 primaries with a replica each, and one primary with a replica watched by 3
Sentinels (``redis-server --sentinel``). Every process listens on a free loopback port (never
6379), persists nothing, and is stopped by :meth:`stop`.

Helpers here speak to the servers through redis-py's synchronous client (the tests' own
clients are the async ones under test).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tests.conftest import free_port

SERVICE = "edgecloud-test"
REPLICAS = ("--cluster-replicas", "1", "--cluster-yes")  # one replica per primary


def _exe() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (see tests/conftest.py)")
    return exe


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


class _Procs:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, port: int, *args: str, conf: Path | None = None) -> None:
        folder = self.workdir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        argv = [_exe(), *([str(conf)] if conf else [])]
        argv += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no", *args]
        self.procs[port] = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(lambda: client(port).ping(), 10, f"redis-server on {port}")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port, None)
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.procs):
            proc = self.procs.pop(port)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too (both at most 65535)."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if port in taken or port + 10000 in taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        taken.add(port)
        return port
    raise RuntimeError("no free port pair for a cluster node")


def client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=2, decode_responses=True)


class LocalCluster(_Procs):
    """3 primaries and 3 replicas, made a cluster by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        taken: set[int] = set()
        self.ports = [free_cluster_port(taken) for _ in range(6)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def start(self) -> None:
        for port in self.ports:
            self.spawn(
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "1000",
            )
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (it comes with redis-server)")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), *REPLICAS],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        wait_for(self.healthy, 30, "the cluster to be ok with a replica per primary")

    def healthy(self) -> bool:
        for port in self.procs:
            if client(port).execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                return False
        primaries = self.primaries()
        replicas = [self.replica_of(p) for p in primaries]
        return len(primaries) == 3 and all(
            r is not None and client(r).execute_command("ROLE")[3] == "connected" for r in replicas
        )

    def _nodes(self) -> list[tuple[int, str, str, str]]:
        """(port, node id, flags, its primary's id) as a live node sees the cluster."""
        for port in self.procs:
            try:
                raw = client(port).execute_command("CLUSTER NODES")
            except redis.RedisError:
                continue
            return [
                (
                    int(addr.rsplit(":", 1)[1].split("@")[0]),
                    n["node_id"],
                    n["flags"],
                    n["master_id"],
                )
                for addr, n in raw.items()
            ]
        return []

    def primaries(self) -> list[int]:
        return sorted(
            port
            for port, _, flags, _ in self._nodes()
            if "master" in flags and "fail" not in flags and port in self.procs
        )

    def replica_of(self, primary: int) -> int | None:
        nodes = self._nodes()
        pid = next((nid for port, nid, _, _ in nodes if port == primary), None)
        for port, _, flags, master in nodes:
            if master == pid and "fail" not in flags and port in self.procs:
                return port
        return None

    def owner(self, key: str) -> int:
        """The primary port that holds ``key``'s slot now."""
        any_port = next(iter(self.procs))
        slot = int(client(any_port).execute_command("CLUSTER KEYSLOT", key))
        for row in client(any_port).execute_command("CLUSTER SLOTS"):
            if row[0] <= slot <= row[1]:
                return int(row[2][1])
        raise RuntimeError(f"slot {slot} is not covered")

    def failover(self, primary: int) -> int:
        """A manual failover: the primary's replica takes over (``CLUSTER FAILOVER``)."""
        replica = self.replica_of(primary)
        assert replica is not None, f"no replica for {primary}"
        client(replica).execute_command("CLUSTER FAILOVER")

        def done() -> bool:
            roles = {p: client(p).execute_command("ROLE")[0] for p in (primary, replica)}
            return roles == {primary: "slave", replica: "master"}

        wait_for(done, 15, "the manual failover")
        return replica

    def kill_primary(self, primary: int) -> int:
        """SIGKILL a primary; returns its replica's port once the cluster elected it and is ok."""
        replica = self.replica_of(primary)
        assert replica is not None, f"no replica for {primary}"
        self.kill(primary)

        def elected() -> bool:
            role = client(replica).execute_command("ROLE")[0]
            return role == "master" and all(
                client(p).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                for p in self.procs
            )

        wait_for(elected, 60, "the cluster to elect the replica")
        return replica


class LocalSentinel(_Procs):
    """One primary, one replica and 3 Sentinels (quorum 2) watching them as ``SERVICE``."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.primary, self.replica = free_port(), free_port()
        self.sentinels = [free_port() for _ in range(3)]

    @property
    def url(self) -> str:
        return (
            "redis+sentinel://"
            + ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
            + (f"/{SERVICE}/0")
        )

    def start(self) -> None:
        self.spawn(self.primary)
        self.spawn(self.replica, "--replicaof", "127.0.0.1", str(self.primary))
        for port in self.sentinels:
            conf = self.workdir / f"sentinel-{port}.conf"
            conf.write_text(
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.spawn(port, "--sentinel", conf=conf)
        wait_for(self.ready, 30, "the Sentinels to see the primary, its replica and each other")

    def ready(self) -> bool:
        for port in self.sentinels:
            c = client(port)
            info = c.execute_command("SENTINEL MASTER", SERVICE)
            if int(info["num-other-sentinels"]) < 2 or int(info["num-slaves"]) < 1:
                return False
        role = client(self.replica).execute_command("ROLE")
        return role[0] == "slave" and role[3] == "connected"

    def current_primary(self) -> int:
        addr = client(self.sentinels[0]).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE
        )
        return int(addr[1])

    def failover(self) -> int:
        """``SENTINEL FAILOVER``: the replica is promoted, the old primary made its replica.
        Returns the new primary's port once every Sentinel names it."""
        old = self.current_primary()
        new = self.replica if old == self.primary else self.primary
        client(self.sentinels[0]).execute_command("SENTINEL", "FAILOVER", SERVICE)

        def switched() -> bool:
            for port in self.sentinels:
                addr = client(port).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                if int(addr[1]) != new:
                    return False
            return True

        wait_for(switched, 30, "the Sentinels to name the new primary")
        return new

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns the new one's port once every Sentinel names it."""
        old = self.current_primary()
        new = self.replica if old == self.primary else self.primary
        self.kill(old)

        def switched() -> bool:
            addrs = [
                client(p).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                for p in self.sentinels
            ]
            return all(int(a[1]) == new for a in addrs)

        wait_for(switched, 60, "the Sentinels to elect a new primary")
        return new
