"""Gateway start-up refuses bad configuration with a clear message, not a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.nodes import REPO, cli

GEO = REPO.parent / "shared" / "data" / "geoip"


def _start(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cli("gateway", "--config", str(cfg), "--port", "0")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(not GEO.is_dir(), reason=f"MaxMind test databases not found at {GEO}")
def test_corrupt_geo_database_is_a_clear_startup_error(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"geo: {{database: {GEO / 'GeoIP2-City-Test-Broken-Double-Format.mmdb'}}}\n")
    r = _start(cfg)
    assert r.returncode == 2
    assert "GeoIP2-City-Test-Broken-Double-Format.mmdb" in r.stderr and "cannot be used" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("text", ["nodes: [unclosed", "port: -5\n", "no_such_field: 1\n"])
def test_bad_config_is_a_clear_startup_error(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(text)
    r = _start(cfg)
    assert r.returncode == 2 and "bad config" in r.stderr and "Traceback" not in r.stderr


def test_edge_serve_huge_pages_flag() -> None:
    from gateway.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["edge", "serve"]).huge_pages is True
    assert parser.parse_args(["edge", "serve", "--no-huge-pages"]).huge_pages is False


def test_serve_hands_its_edge_flags_to_the_edge_node(tmp_path: Path) -> None:
    from gateway.cli import build_parser
    from gateway.commands.gateway import _node_argv

    parser = build_parser()
    args = parser.parse_args(["serve", "--edge-slots", "8", "--edge-prefix-first", "0"])
    argv = _node_argv("edge", args, tmp_path, 9001, 1)
    assert argv[argv.index("--slots") + 1] == "8"
    assert parser.parse_args(argv[3:]).slots == 8  # the edge node takes what it gets
    assert argv[argv.index("--prefix-first") + 1] == "0"
    assert "--slots" not in _node_argv("cloud", args, tmp_path, 9002, 1)
    assert parser.parse_args(["serve"]).edge_slots == 4
    with pytest.raises(SystemExit):  # argparse's usage error: at least one slot
        parser.parse_args(["serve", "--edge-slots", "0"])
