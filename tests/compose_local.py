"""Run deploy/compose.yaml's services as local processes (there is no Docker engine here).

Each container's network becomes loopback: a service's ``--port N`` gets a free local port, and
``SERVICE:N`` (and the service's own ``127.0.0.1:N``, ``0.0.0.0``) in every command, variable,
healthcheck and mounted config file is rewritten to it; bind-mounted files are mapped to their
host paths (config files rewritten the same way). Commands run as the images run them: through
deploy/docker/entrypoint.sh, with an ``edgecloud`` on PATH that is this checkout's CLI.
Healthchecks run as written (deploy/docker/healthcheck.py, redis-cli). Variables are
interpolated as compose does (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import free_port
from tests.deploy_files import COMPOSE, DEPLOY
from tests.nodes import REPO

_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::([-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` with compose's variables substituted, recursively; ``$$`` is a literal ``$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"${name}: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(sub, value).replace("$$", "$")


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    port: int | None = None  # its container port (``--port N``)
    local: int | None = None  # the loopback port standing in for it
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def command(self) -> list[str]:
        return [str(a) for a in self.spec.get("command", [])]


class LocalCompose:
    """The compose project's services as processes under ``workdir``; ``stop()`` ends them."""

    def __init__(self, workdir: Path, env: dict[str, str], skip: set[str]) -> None:
        self.workdir, self.env = workdir, env
        doc = interpolate(yaml.safe_load(COMPOSE.read_text()), env)
        self.services = {
            name: Service(name, spec) for name, spec in doc["services"].items() if name not in skip
        }
        for s in self.services.values():
            cmd = s.command
            if "--port" in cmd:
                s.port = int(cmd[cmd.index("--port") + 1])
                s.local = free_port()
        self.bin = workdir / "bin"
        self.bin.mkdir(exist_ok=True)
        shim = self.bin / "edgecloud"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gateway.cli "$@"\n')
        shim.chmod(0o755)

    def rewrite(self, text: str, own: Service) -> str:
        for s in self.services.values():
            if s.port is not None:
                text = text.replace(f"{s.name}:{s.port}", f"127.0.0.1:{s.local}")
        if own.port is not None:
            text = text.replace(f"127.0.0.1:{own.port}", f"127.0.0.1:{own.local}")
        return text.replace("0.0.0.0", "127.0.0.1")

    def _mounts(self, s: Service) -> dict[str, str]:
        """Container path -> host path of ``s``'s bind mounts (config files rewritten)."""
        out: dict[str, str] = {}
        for mount in s.spec.get("volumes", []):
            source, target = mount.split(":")[:2]
            if source.startswith(("./", "/")):  # else a named volume: EDGECLOUD_HOME stands in
                out[target] = str((DEPLOY / source).resolve())
        for target, host in list(out.items()):
            if host.endswith((".yaml", ".yml")):  # a config file: rewritten like the commands
                text = self.rewrite(Path(host).read_text(), s)
                for inner, other in out.items():
                    text = text.replace(inner, other)
                copy = self.workdir / f"{s.name}-{Path(host).name}"
                copy.write_text(text)
                out[target] = str(copy)
        return out

    def _args(self, s: Service, values: list[str]) -> list[str]:
        mounts = self._mounts(s)
        out = []
        for v in values:
            v = self.rewrite(v, s)
            for target, host in mounts.items():
                v = v.replace(target, host)
            out.append(v)
        return out

    def start(self, s: Service) -> None:
        cmd = self._args(s, s.command)
        if s.port is not None:
            cmd[cmd.index("--port") + 1] = str(s.local)
        env = {k: self.rewrite(str(v), s) for k, v in (s.spec.get("environment") or {}).items()}
        s.env = {**os.environ, **self.env, **env, "PATH": f"{self.bin}:{os.environ['PATH']}"}
        if cmd[0] != "redis-server":  # the images' ENTRYPOINT (tini aside) before the command
            cmd = ["sh", str(DEPLOY / "docker" / "entrypoint.sh"), *cmd]
        s.log = self.workdir / f"{s.name}.log"
        with open(s.log, "wb") as log:
            s.proc = subprocess.Popen(cmd, cwd=REPO, env=s.env, stdout=log, stderr=log)

    def healthy(self, s: Service) -> bool:
        """Run ``s``'s healthcheck as written; raise if its process has died."""
        assert s.proc is not None
        if s.proc.poll() is not None:
            raise RuntimeError(f"{s.name} exited {s.proc.returncode}: {self.tail(s)}")
        test = self._args(s, s.spec["healthcheck"]["test"])
        assert test[0] == "CMD", test
        argv = test[1:]
        if argv[0] == "edgecloud-healthcheck":
            argv = [sys.executable, str(DEPLOY / "docker" / "healthcheck.py"), *argv[1:]]
        r = subprocess.run(argv, env=s.env, capture_output=True, timeout=10)
        return r.returncode == 0

    def wait_healthy(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(names)
        while pending:
            pending = [n for n in pending if not self.healthy(self.services[n])]
            if pending and time.monotonic() > deadline:
                tails = {n: self.tail(self.services[n]) for n in pending}
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {tails}")
            time.sleep(0.3)

    def up(self, timeout: float = 300.0) -> None:
        """Start every service once the ones it depends on are healthy (compose's
        ``service_healthy``), then wait until all are healthy."""
        started: set[str] = set()
        while len(started) < len(self.services):
            for name, s in self.services.items():
                deps = [d for d in (s.spec.get("depends_on") or {}) if d in self.services]
                if name not in started and set(deps) <= started:
                    self.wait_healthy(deps, timeout)
                    self.start(s)
                    started.add(name)
        self.wait_healthy(list(self.services), timeout)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.services[name].local}"

    def tail(self, s: Service, n: int = 1500) -> str:
        return s.log.read_bytes()[-n:].decode(errors="replace") if s.log else ""

    def stop(self) -> dict[str, int]:
        """SIGTERM every process (they drain), in reverse start order; their exit codes."""
        codes = {}
        for s in reversed(list(self.services.values())):
            if s.proc is not None and s.proc.poll() is None:
                s.proc.terminate()
        for s in self.services.values():
            if s.proc is not None:
                try:
                    codes[s.name] = s.proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    codes[s.name] = s.proc.wait()
        return codes
