"""deploy/ checked with the tools operators use, offline: yamllint, the compose spec
(check-jsonschema), hadolint on the Dockerfile, systemd-analyze on the unit, the install
script's files, and that every file the Dockerfile, compose and chart copy or mount exists."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy_files import CHART, COMPOSE, DEPLOY, DOCKERFILE
from tests.nodes import REPO

BIN = Path(sys.executable).parent  # the venv's console scripts (the test extra's tools)


def tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or pytest.fail(f"{name} missing"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_yamllint_passes_on_deploy() -> None:
    r = run(tool("yamllint"), "--strict", "-c", ".yamllint.yaml", "deploy")
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_file_follows_the_compose_spec() -> None:
    r = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_passes_on_the_dockerfile() -> None:
    r = run(tool("hadolint"), str(DOCKERFILE))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_dockerfile_target_is_there_and_runs_as_non_root_under_tini() -> None:
    text = DOCKERFILE.read_text()
    targets = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert {"gateway", "edge", "edge-openvino", "cloud"} <= set(targets)
    for target in ("gateway", "edge", "edge-openvino", "cloud"):
        stage = text.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "USER 10001" in stage and "HEALTHCHECK" in stage, target
        assert 'ENTRYPOINT ["tini", "--", "edgecloud-entrypoint"]' in stage, target


def copied_sources() -> set[str]:
    """Every COPY source of the Dockerfile that comes from the build context."""
    out = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            out.update(line.split()[1:-1])
    return out


def test_every_file_copied_or_mounted_exists() -> None:
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    kept = {x[1:].rstrip("/") for x in ignore if x.startswith("!")}
    for src in copied_sources():
        assert (REPO / src).exists(), src
        assert any(src == k or src.startswith(k + "/") for k in kept), f"{src} is .dockerignored"
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, svc in compose["services"].items():
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("./"):  # a file of this repository (${...}: the operator's)
                assert (DEPLOY / source).exists(), f"{name}: {source}"
        build = svc.get("build")
        if build:
            assert (COMPOSE.parent / build["context"] / build["dockerfile"]).exists()
    for template in (CHART / "templates").glob("*"):
        for path in re.findall(r'\.Files\.Get "([^"]+)"', template.read_text()):
            assert (CHART / path).exists(), f"{template.name}: {path}"
    assert (DEPLOY / "systemd" / "edgecloud-edge.service").exists()


def test_systemd_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    # systemd-analyze checks that ExecStart's program exists: stand one in for the venv's
    exe = tmp_path / "edgecloud"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    unit = tmp_path / "edgecloud-edge.service"
    text = (DEPLOY / "systemd" / "edgecloud-edge.service").read_text()
    unit.write_text(text.replace("/opt/edgecloud/bin/edgecloud", str(exe)))
    r = run("systemd-analyze", "verify", "--man=no", str(unit))
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    r = run("systemd-analyze", "security", "--offline=yes", "--threshold=30", str(unit))
    assert r.returncode == 0, r.stdout[-2000:]
    for setting in ("ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes",
                    "User=edgecloud", "Restart=on-failure", "--region ${EDGECLOUD_REGION}",
                    "--redis ${EDGECLOUD_REDIS_URL}"):  # fmt: skip
        assert setting in text, setting


def test_install_script_writes_a_private_env_file_and_the_unit(tmp_path: Path) -> None:
    env = {**os.environ, "DESTDIR": str(tmp_path), "EDGECLOUD_NODE_TOKEN": "t" * 32}
    env["EDGECLOUD_NODE_TLS"] = "/etc/edgecloud/node-tls"
    args = ["bash", "deploy/systemd/install.sh", "--files-only", "--region", "eu-west"]
    args += ["--redis-url", "redis://r:6379/0", "--public-url", "http://e1:8001"]
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    env_file = tmp_path / "etc" / "edgecloud" / "edge.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o640
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert values["EDGECLOUD_REGION"] == "eu-west" and values["EDGECLOUD_NODE_TOKEN"] == "t" * 32
    assert values["EDGECLOUD_REDIS_URL"] == "redis://r:6379/0"
    assert values["EDGECLOUD_NODE_TLS"] == "/etc/edgecloud/node-tls"
    unit = tmp_path / "etc" / "systemd" / "system" / "edgecloud-edge.service"
    assert unit.read_text() == (DEPLOY / "systemd" / "edgecloud-edge.service").read_text()
    missing = subprocess.run(
        ["bash", "deploy/systemd/install.sh", "--files-only", "--region", "x"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "--redis-url is required" in missing.stderr
