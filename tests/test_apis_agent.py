"""A real coding agent through the gateway (slow; left out of CI): Claude Code in print mode
with its base URL on the gateway's Messages API completes one trivial non-interactive turn.

The agent comes from npm (``@anthropic-ai/claude-code``): the test runs the ``claude`` on the
PATH, or the one ``$EDGECLOUD_CLAUDE`` names, and is skipped without one. Its default system
prompt and built-in tools need far more context than the default model has, so the turn runs
with a short ``--system-prompt`` and no tools; the agent still speaks its own Messages API
(streaming, its headers, its model name through ``model_aliases``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nodes import Served, gateway_over, serve_node

pytestmark = pytest.mark.slow


def _claude() -> str | None:
    return os.environ.get("EDGECLOUD_CLAUDE") or shutil.which("claude")


@pytest.fixture(scope="module")
def gateway(default_model_path: Path) -> Iterator[str]:
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine
    from routing.model_store import resolve

    model = resolve(default_model_path).name
    served: list[Served] = []
    try:
        cloud = CloudEngine.from_model(
            default_model_path, "cpu", config=EngineConfig(device="cpu", kv_memory_bytes=96 << 20)
        )
        served.append(serve_node(cloud, default_model_path, "cloud-agent"))
        served.append(gateway_over(served[0].url, model_aliases={"claude-*": model}))
        yield served[-1].url
    finally:
        for s in reversed(served):
            s.stop()


def test_claude_code_print_mode_turn(gateway: str, tmp_path: Path) -> None:
    claude = _claude()
    if claude is None:
        pytest.skip("Claude Code is not installed (npm i @anthropic-ai/claude-code)")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": gateway,
        "ANTHROPIC_API_KEY": "unused",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "MAX_THINKING_TOKENS": "0",  # thinking is refused by name (docs/apis.md)
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512",  # its default budget exceeds the model's context
    }
    done = subprocess.run(
        [claude, "-p", "Say hello.", "--model", "claude-sonnet-4-5", "--tools", "",
         "--system-prompt", "Answer with one word.", "--output-format", "json"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = json.loads(done.stdout)
    # every request the agent made was served (no API error status); a tiny model may still
    # ramble past the agent's output budget, which the agent itself reports as an error
    assert out.get("api_error_status") is None, out
    assert out["usage"]["output_tokens"] > 0 and out["modelUsage"], out
    if "exceeded" not in str(out.get("result")):
        assert done.returncode == 0 and out.get("is_error") is False and out.get("result"), out
