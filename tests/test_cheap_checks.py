"""The cheap checks first: auth and rate limits before a body is read or a prompt tokenized, a
total body deadline beside the stall timeout, and failed-auth throttling per client address.

Real parts: the real gateway (in process under uvicorn over a real tiny cloud node, or as
the ``edgecloud gateway`` process with its guarded HTTP server) and raw sockets or the
official openai SDK as clients. Assertions are on statuses and counts.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

import routing.profile
from gateway.auth import generate_key, hash_key
from tests.conftest import free_port
from tests.nodes import Proc, Served, cli, serve_node, tiny_cloud_engine

SALT = "cheap-checks-salt-7Qx!c2Lm9Pz"
KEYS = {name: generate_key() for name in ("alice", "ops")}


def _auth(**alice: Any) -> dict[str, Any]:
    return {
        "salt": SALT,
        "keys": [{"name": "alice", "key_hash": hash_key(KEYS["alice"], SALT), **alice}],
        "admin_keys": [{"name": "ops", "key_hash": hash_key(KEYS["ops"], SALT)}],
        "failed_auth_per_minute": 5,
    }


@pytest.fixture(scope="module")
def gw(tiny_model_path: Path, one_torch_thread: None) -> Iterator[str]:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    node = serve_node(tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-cc")
    cfg = GatewayConfig(nodes=[node.url], poll_interval_s=0.2, auth=_auth(rpm=1))
    served = Served(create_gateway_app(cfg))
    admin = {"authorization": f"Bearer {KEYS['ops']}"}
    deadline = time.monotonic() + 30
    while not httpx.get(served.url + "/admin/nodes", headers=admin).json()["nodes"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield served.url
    served.stop()
    node.stop()


def test_over_limit_key_gets_429_before_its_prompt_is_tokenized(
    gw: str, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = routing.profile.prompt_token_ids

    def counted(*args: Any, **kwargs: Any) -> list[int]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(routing.profile, "prompt_token_ids", counted)
    client = openai.OpenAI(base_url=gw + "/v1", api_key=KEYS["alice"], max_retries=0)
    model = tiny_model_path.name
    client.completions.create(model=model, prompt="hello", max_tokens=1)  # its one a minute
    assert len(calls) == 1
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=model, prompt="word " * 780_000, max_tokens=1)
    # the translated APIs charge before they read the body too
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model=model, input="word " * 780_000, max_output_tokens=1)
    claude = anthropic.Anthropic(base_url=gw, api_key=KEYS["alice"], max_retries=0)
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.create(
            model=model, max_tokens=1, messages=[{"role": "user", "content": "word " * 780_000}]
        )
    assert len(calls) == 1, "the over-limit prompts were never tokenized"


def test_admin_key_is_checked_before_the_body_is_read(gw: str) -> None:
    """A POST /admin/policy whose body never comes is answered 401 at once (not 408 after the
    body timeout): the admin key is checked before the body is read."""
    host, port = gw.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /admin/policy HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEYS["alice"].encode() + b"\r\n"
            b"content-length: 100000\r\n\r\n"
        )
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head[:80]


def test_failed_auth_is_throttled_per_address(gw: str) -> None:
    """Runs after the other tests of this gateway: its address is throttled from here on."""
    body = {"model": "m", "prompt": "x"}
    statuses = [
        httpx.post(
            gw + "/v1/completions", json=body, headers={"authorization": f"Bearer wrong-{i}"}
        ).status_code
        for i in range(7)
    ]
    # 5 a minute, one spent by the user key sent to /admin/policy in the test before
    assert statuses == [401] * 4 + [429] * 3
    refused = httpx.post(gw + "/admin/policy", json={}, headers={"authorization": "Bearer x"})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_failed_auth"


@pytest.mark.parametrize("clients", [500])
def test_trickled_bodies_are_cut_by_the_total_deadline(tmp_path: Path, clients: int) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"auth": _auth()}))
    port = free_port()
    args = ["--config", str(cfg), "--port", str(port), "--max-connections", str(clients)]
    limits = ["--body-deadline", "2", "--body-timeout", "30"]
    proc = Proc(cli("gateway", *args, *limits), port, tmp_path / "gw.log").wait_ready(path="/livez")
    try:
        closed = asyncio.run(_trickle(port, clients))
        assert closed == clients, f"{closed} of {clients} trickling connections were cut"
        served = httpx.get(proc.url + "/livez", timeout=10)  # a new client
        assert served.status_code == 200
        assert "server" not in served.headers  # replies do not name the server software
    finally:
        proc.stop()


async def _trickle(port: int, n: int) -> int:
    """Open ``n`` connections that trickle an unauthenticated body a byte every 0.5 s;
    how many the server closed within 30 s."""
    head = (
        b"POST /admin/policy HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n"
    )

    async def one() -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    writer.write(b" ")
                    await writer.drain()
                except (ConnectionError, OSError):
                    return True
                try:
                    while await asyncio.wait_for(reader.read(65536), 0.5):
                        pass
                    return True  # EOF: the server closed it
                except TimeoutError:
                    continue
                except (ConnectionError, OSError):
                    return True
            return False
        finally:
            writer.close()

    opened = []
    for _ in range(n):  # all open before any is cut: they hold the cap together
        opened.append(asyncio.create_task(one()))
        await asyncio.sleep(0)
    return sum(await asyncio.gather(*opened))
