"""Packaging by role: the core install is the gateway (no torch, no onnxruntime), extras add
the edge (or OpenVINO in its place), the cloud engine and the simulator.

The light-gateway test runs the real ``edgecloud gateway`` in a process that sees only the core
install's distributions (``tests.light_env``: torch, onnxruntime, the engines, every extra's and
test tool's modules cannot be imported there), in front of a real tiny cloud node, and serves a
request through it.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.requirements import Requirement

from routing.fleet.state import NODE_API_VERSION
from tests.conftest import free_port
from tests.nodes import REPO, Proc, cli

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
HEAVY = {"torch", "onnxruntime", "onnxruntime-openvino", "onnx", "onnxscript", "optuna"}
HEAVY |= {"matplotlib"}


def names(reqs: list[str]) -> set[str]:
    return {Requirement(r).name.lower() for r in reqs}


def test_the_core_install_is_the_gateway_and_roles_are_extras() -> None:
    core = names(PROJECT["dependencies"])
    assert not core & HEAVY, core & HEAVY
    assert {"fastapi", "httpx", "redis", "geoip2", "tokenizers", "pydantic"} <= core
    assert "onnxruntime" in names(EXTRAS["edge"])
    assert "torch" in names(EXTRAS["cloud"])
    assert {"optuna", "matplotlib"} <= names(EXTRAS["sim"])
    # edge-openvino replaces onnxruntime: never both in one environment
    assert "onnxruntime" not in names(EXTRAS["edge-openvino"])
    assert "onnxruntime-openvino" in names(EXTRAS["edge-openvino"])
    assert {"edgecloud"} == names(EXTRAS["all"])  # edge, cloud and sim, for `serve`
    assert set(Requirement(EXTRAS["all"][0]).extras) == {"edge", "cloud", "sim"}


@pytest.fixture(scope="module")
def cloud_node(tiny_model_path: Path, tiny_home: dict[str, str], tmp_path_factory):
    """A real tiny cloud node (full environment) for the light gateway to route to."""
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "cloud.log"
    args = cli(
        "cloud", "serve", "--model", str(tiny_model_path), "--port", str(port),
        "--device", "cpu", "--threads", "1", "--node-id", "cloud-light", "--region", "eu",
    )  # fmt: skip
    p = Proc(args, port, log, env=tiny_home).wait_ready()
    yield p
    assert p.stop() == 0, p.tail()


def test_gateway_without_torch_or_onnxruntime_serves_a_node(
    cloud_node: Proc, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"nodes": [cloud_node.url], "poll_interval_s": 0.2}))
    modules_file = tmp_path / "modules.json"
    port = free_port()
    args = [sys.executable, "-m", "tests.light_env", str(modules_file)]
    args += ["gateway", "--config", str(config), "--port", str(port)]
    gw = Proc(args, port, tmp_path / "gateway.log").wait_ready(timeout=60, path="/readyz")
    try:
        assert httpx.get(gw.url + "/livez").status_code == 200
        assert httpx.get(gw.url + "/startupz").status_code == 200
        model = httpx.get(cloud_node.url + "/v1/models").json()["data"][0]["id"]
        assert httpx.get(cloud_node.url + "/load").json()["api_version"] == NODE_API_VERSION
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-edgecloud-node"] == "cloud-light"
        assert r.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(gw.url + "/metrics").text  # the fleet gauges of the dashboard
        for series in ("node_running", "node_kv_blocks_total", "circuit_open"):
            assert f'edgecloud_{series}{{node="cloud-light",tier="cloud"}}' in metrics, series
    finally:
        assert gw.stop() == 0, gw.tail()
    modules = json.loads(modules_file.read_text())
    loaded, hidden = set(modules["loaded"]), set(modules["hidden"])
    # installed here, and hidden from the gateway as they would be absent from its machine
    assert {"torch", "onnxruntime", "optuna", "matplotlib", "cloud_engine"} <= hidden
    assert not loaded & hidden
    assert {"fastapi", "httpx", "tokenizers", "redis"} <= loaded  # it did route and tokenize
