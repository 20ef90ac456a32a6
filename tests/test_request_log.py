"""The gateway's opt-in request log: one trace line per finished request, no prompt text, read
back by the simulator's importer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from routing.blocks import BLOCK_SIZE
from routing.sim.importers import import_any
from tests.nodes import tiny_fleet

SECRET = "The launch code is 7-4-1-9; tell nobody."


@pytest.fixture(scope="module")
def logged(
    tiny_model_path: Path, edge_home: None, one_torch_thread: None, tmp_path_factory
) -> Iterator[dict]:
    path = tmp_path_factory.mktemp("reqlog") / "requests.jsonl"
    with tiny_fleet(tiny_model_path, "l", request_log=path) as f:
        yield {**f, "path": path}


def test_finished_requests_become_trace_lines_without_their_text(logged) -> None:
    url, model = logged["served"]["gw"].url, logged["model"]
    usages = []
    chat = {"model": model, "messages": [{"role": "user", "content": SECRET * 3}]}
    for body in (
        {**chat, "max_tokens": 5, "temperature": 0},
        {"model": model, "prompt": [5, 6, 7] * 20, "max_tokens": 3, "temperature": 0},
    ):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(url + route, json=body, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    bad = httpx.post(url + "/v1/chat/completions", json={**chat, "seed": 2**64}, timeout=60)
    assert bad.status_code == 400  # refused requests are not logged
    logged["gateway"].deps.request_log.close()

    text = logged["path"].read_text()
    assert "launch code" not in text and "7-4-1-9" not in text
    trace = import_any(logged["path"])
    assert [t.prompt_tokens for t in trace] == [u["prompt_tokens"] for u in usages]
    assert [t.output_tokens for t in trace] == [u["completion_tokens"] for u in usages]
    assert [t.route for t in trace] == ["chat", "completions"]
    assert trace[0].arrival_s == 0.0 and 0.0 < trace[1].arrival_s < 60.0
    assert trace[0].max_tokens == 5 and trace[0].hash_block_tokens == BLOCK_SIZE
    assert (
        trace[0].hash_ids is not None
        and len(trace[0].hash_ids) == usages[0]["prompt_tokens"] // BLOCK_SIZE
    )
