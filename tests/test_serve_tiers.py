"""``edgecloud serve --cloud-device``: which tiers the embedded default runs. ``auto`` (the
default) runs the cloud node where a CUDA device is visible and otherwise the edge node alone on
every core with 16 slots; ``cuda`` or ``cpu`` runs it there, ``off`` never."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from gateway.cli import build_parser
from gateway.commands.serve import ALONE_EDGE_SLOTS, cuda_visible, wants_cloud
from tests.conftest import free_port
from tests.nodes import Proc, cli


def test_cloud_choice_follows_the_device_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).cloud_device is None  # auto
    assert wants_cloud(parser.parse_args(["serve", "--cloud-device", "cpu"])) is True
    assert wants_cloud(parser.parse_args(["serve", "--cloud-device", "cuda"])) is True
    assert wants_cloud(parser.parse_args(["serve", "--cloud-device", "off"])) is False
    assert wants_cloud(parser.parse_args(["serve"])) is cuda_visible()
    assert wants_cloud(parser.parse_args(["serve", "--cloud-device", "auto"])) is cuda_visible()


@pytest.mark.skipif(cuda_visible(), reason="a CUDA device is visible: auto runs the cloud node")
def test_serve_on_a_cpu_only_machine_runs_the_edge_alone(
    tiny_model_path: Path, tiny_home: dict[str, str], tmp_path: Path
) -> None:
    port, edge_port = free_port(), free_port()
    args = cli(
        "serve", "--model", str(tiny_model_path), "--port", str(port), "--edge-port",
        str(edge_port), "--edge-variant", "fp32",
    )  # fmt: skip
    p = Proc(args, port, tmp_path / "serve.log", env=tiny_home).wait_ready(240, "/v1/models")
    try:
        nodes = httpx.get(p.url + "/admin/nodes", timeout=10).json()["nodes"]
        assert [n["kind"] for n in nodes] == ["edge"], nodes
        assert nodes[0]["max_batch"] == ALONE_EDGE_SLOTS  # sized as a node alone
        r = httpx.post(
            p.url + "/v1/chat/completions",
            json={
                "model": "auto",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["x-edgecloud-tier"] == "edge"
        agent = {"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}]}  # fmt: skip
        r = httpx.post(p.url + "/v1/messages", json=agent, timeout=60)  # Claude Code's name
        assert r.status_code == 200 and r.json()["model"] == tiny_model_path.name, r.text
        agent["model"] = "no-such-model"
        r = httpx.post(p.url + "/v1/messages", json=agent, timeout=60)
        assert r.status_code == 404 and "served here: auto" in r.text, r.text
    finally:
        assert p.stop(signal.SIGINT, timeout=60) == 0, p.tail()
    log = (tmp_path / "serve.log").read_text()
    assert "starting edge node on every core alone (no cloud node" in log, log
