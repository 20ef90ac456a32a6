"""Each image target's ENTRYPOINT and CMD (deploy/docker/Dockerfile) run as a local process
answers the target's own HEALTHCHECK (no Docker engine here). The process is the entrypoint
script with the target's CMD and ENV, its port moved to a free one and 0.0.0.0 to loopback;
tini (PID 1 in the image) is left out where it is not installed. The edge gets ``--variant
fp32`` after its CMD (the quality gate of ``auto`` takes minutes); edge-openvino is not run:
its provider needs onnxruntime-openvino, which cannot share this environment."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port
from tests.deploy_files import DEPLOY, DOCKERFILE
from tests.nodes import REPO


def stage(target: str) -> dict[str, object]:
    """The target's CMD (list), ENV (dict) and HEALTHCHECK command."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    body = text.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", body, re.M):
        env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    cmd = json.loads(re.search(r"^CMD (\[.+\])$", body, re.M).group(1))
    health = json.loads(re.search(r"^HEALTHCHECK .* CMD (\[.+\])$", body, re.M).group(1))
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.+\])$", body, re.M).group(1))
    return {"cmd": cmd, "env": env, "health": health, "entry": entry}


@pytest.mark.parametrize("target", ["gateway", "edge", "cloud"])
def test_image_command_answers_its_healthcheck(
    target: str, tiny_model_path: Path, tiny_home: dict[str, str], tmp_path: Path
) -> None:
    s = stage(target)
    assert s["entry"] == ["tini", "--", "edgecloud-entrypoint"]
    cmd = [str(a).replace("0.0.0.0", "127.0.0.1") for a in s["cmd"]]
    port = free_port()
    image_port = cmd[cmd.index("--port") + 1]
    cmd[cmd.index("--port") + 1] = str(port)
    if target == "gateway":
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"nodes": []}))
        cmd = [str(config) if a == "/etc/edgecloud/gateway.yaml" else a for a in cmd]
    if target == "edge":
        cmd += ["--variant", "fp32", "--threads", "1"]
    if target == "cloud":
        cmd += ["--threads", "1"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "edgecloud").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gateway.cli "$@"\n')
    (bin_dir / "edgecloud").chmod(0o755)
    image_env = {k: v for k, v in s["env"].items() if k not in ("PATH", "EDGECLOUD_HOME")}
    health_url = image_env["EDGECLOUD_HEALTH_URL"].replace(f":{image_port}/", f":{port}/")
    env = {**os.environ, **image_env, **tiny_home, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env |= {"EDGECLOUD_HEALTH_URL": health_url, "EDGECLOUD_NODE_TOKEN": secrets.token_hex(20)}
    if target != "gateway":
        env["EDGECLOUD_MODEL"] = str(tiny_model_path)  # the image's default, pulled: too big
    argv = ["sh", str(DEPLOY / "docker" / "entrypoint.sh"), *cmd]
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=out)
    health = [sys.executable, str(DEPLOY / "docker" / "healthcheck.py")]
    assert s["health"] == ["edgecloud-healthcheck"]
    try:
        deadline = time.monotonic() + 180
        while subprocess.run(health, env=env, capture_output=True).returncode != 0:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.3)
    finally:
        proc.terminate()  # SIGTERM, as tini passes it on: the drain, then exit 0
        assert proc.wait(timeout=40) == 0, log.read_text()[-2000:]
