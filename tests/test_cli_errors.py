"""The CLI's one error path: a user's mistake is one line that says what to do, with an exit
code, never a traceback (``--debug`` keeps it); every option has help text."""

from __future__ import annotations

import argparse
import socket
import subprocess
from pathlib import Path

import pytest

from gateway.cli import EXIT_BUG, all_parsers, build_parser, main
from tests.nodes import REPO, cli


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli(*args)], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_unknown_model_says_what_is_pullable_and_stored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["chat", "hi", "--model", "nosuch"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "model 'nosuch' is not in the store" in err
    assert "pullable: smollm2-135m-instruct" in err
    assert "models pull nosuch" not in err and "Traceback" not in err


def test_unknown_model_in_a_subprocess_has_no_traceback_and_debug_has_one() -> None:
    r = _run("edge", "export", "nosuch")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pullable:" in r.stderr
    r = _run("--debug", "chat", "hi", "--model", "nosuch")
    assert r.returncode != 0 and "Traceback" in r.stderr and "ModelNotFound" in r.stderr


def test_pull_of_an_unknown_name_and_a_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", "nosuch"]) == 1
    assert "pullable names are smollm2-135m-instruct" in capsys.readouterr().err
    assert main(["models", "pull", "x", "--from", "/no/such.whl"]) == 1
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["chat", "hi", "--max-tokens", "0"],
            "--max-tokens: 0 is not a whole number of at least 1",
        ),
        (["chat", "hi", "--temperature", "5"], "is not a temperature in [0, 2]"),
        (["gateway", "--port", "70000"], "is not a port number"),
        (["edge", "serve", "--port", "x"], "'x' is not a port number"),
        (["cloud", "serve", "--max-running", "0"], "0 is not a whole number of at least 1"),
        (["serve", "--cloud-max-running", "-2"], "-2 is not a whole number of at least 1"),
        (["cloud", "serve", "--device", "gpu"], "'gpu' is not a device: cuda, cuda:N, cpu or auto"),
        (
            ["serve", "--cloud-device", "gpu"],
            "'gpu' is not a device: cuda, cuda:N, cpu, auto or off",
        ),
    ],
)
def test_bad_flag_values_are_usage_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_gateway_without_config_refuses_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no nodes to route to: pass --config FILE" in err and "examples/gateway.yaml" in err


def test_port_in_use_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("nodes: [http://127.0.0.1:9]\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["gateway", "--config", str(cfg), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err


def test_missing_config_file_and_bad_policy_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gateway", "--config", str(tmp_path / "nope.yaml"), "--port", "0"]) == 2
    assert "bad config" in capsys.readouterr().err


def test_an_unexpected_exception_is_one_line_asking_for_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gateway.commands.models as models

    def boom(_: argparse.Namespace) -> int:
        raise TypeError("wrong")

    monkeypatch.setattr(models, "cmd_list", boom)
    assert main(["models", "list"]) == EXIT_BUG
    err = capsys.readouterr().err
    assert "internal error: TypeError: wrong" in err and "--debug" in err


def test_every_option_has_help_and_the_top_level_help_is_for_users() -> None:
    parser = build_parser()
    top = parser.format_help()
    assert "OpenAI-compatible" in top and "gateway.commands" not in top
    missing = []
    for p in all_parsers(parser):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction) or a.help == argparse.SUPPRESS:
                continue
            if not (a.help or "").strip():
                missing.append(f"{p.prog} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, missing
    chat = next(p for p in all_parsers(parser) if p.prog == "edgecloud chat").format_help()
    assert "(default: 256)" in chat.replace("\n", " ").replace("  ", " ")
    cloud = next(p for p in all_parsers(parser) if p.prog == "edgecloud cloud serve")
    assert "cuda, cuda:N, cpu or auto" in " ".join(cloud.format_help().split())


@pytest.mark.parametrize("node", ["edge", "cloud"])
def test_a_node_port_in_use_names_the_flag_that_sets_it(
    node: str, tiny_model_path: Path, tiny_home: dict[str, str]
) -> None:
    """``serve`` with its edge (cloud) node's port taken says to pick another with
    ``--edge-port`` (``--cloud-port``), before it starts anything."""
    import os

    from tests.conftest import free_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ports = {"edge": free_port(), "cloud": free_port(), node: taken}
        r = subprocess.run(
            cli("serve", "--model", str(tiny_model_path), "--port", str(free_port()),
                "--edge-port", str(ports["edge"]), "--cloud-port", str(ports["cloud"]),
                "--cloud-device", "cpu"),
            cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**os.environ, **tiny_home},
        )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"port {taken} on 127.0.0.1 is already in use" in r.stderr
    assert f"pick another port with --{node}-port" in r.stderr and "Traceback" not in r.stderr
    assert "starting edge node" not in r.stderr


def test_serve_of_a_model_it_cannot_pull_says_what_works(tiny_home: dict[str, str]) -> None:
    """``serve --model llama-3-8b`` (not in the store, not pullable by name) names what is
    pullable and the command that imports a local file, never a flag ``serve`` lacks."""
    import os

    r = subprocess.run(
        cli("serve", "--model", "llama-3-8b", "--port", "0"),
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, **tiny_home},
    )  # fmt: skip
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "edgecloud serve: error: model 'llama-3-8b' is not in the store" in r.stderr
    assert "pullable: smollm2-135m-instruct (edgecloud models pull NAME)" in r.stderr
    assert "edgecloud models pull NAME --from FILE" in r.stderr
    assert "pass --from" not in r.stderr and "Traceback" not in r.stderr
