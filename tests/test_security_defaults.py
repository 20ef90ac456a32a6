"""Safe defaults for auth and exposure (issue 15, item 7), with a real gateway and a real tiny
cloud node on loopback, and the real CLI.

- A node given a token answers 401 without it (``/health`` stays open); a gateway with the same
  token works end to end (``/load``, ``/prefix/events``, ``/tokenizer``, completions).
- ``edgecloud gateway`` and ``edge serve`` refuse a non-loopback host without auth / a node token.
- Weak salts and well-known keys are refused when the config is loaded.
- ``/v1/route`` hides node URLs from non-admins and charges their rate limit; with auth off, a
  caller behind a forwarding proxy is not local: no admin API, no URLs.
- A body not declared JSON is still a 415.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth import AuthConfig, generate_key, hash_key
from tests.nodes import REPO, Served, cli, serve_node, tiny_cloud_engine

TOKEN = secrets.token_urlsafe(24)
SALT = secrets.token_urlsafe(24)
USER, ADMIN = generate_key(), generate_key()


@pytest.fixture(scope="module")
def node(tiny_model_path: Path, one_torch_thread: None) -> Iterator[dict[str, Any]]:
    from routing.model_store import resolve

    info = resolve(tiny_model_path)
    engine = tiny_cloud_engine(tiny_model_path)
    served = serve_node(engine, tiny_model_path, "sec-cloud", node_token=TOKEN)
    try:
        yield {"url": served.url, "model": info.name}
    finally:
        served.stop()


def _gateway(node: dict[str, Any], **config: Any) -> Served:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    cfg = GatewayConfig(nodes=[node["url"]], node_token=TOKEN, **config)
    gw = Served(create_gateway_app(cfg))
    return gw


def _wait_nodes(gw: Served, headers: dict[str, str] | None = None) -> None:
    """Until the gateway sees the node and has its tokenizer (fetched on a first request: on a
    busy machine that can outlast a polled state's TTL once)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.get(gw.url + "/admin/nodes", headers=headers)
        if r.status_code == 200 and r.json()["nodes"]:
            model = r.json()["nodes"][0]["models"][0]
            route = httpx.post(gw.url + "/v1/route", json=_chat(model), headers=headers)
            if route.status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError("the gateway never saw the node")


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_node_without_the_token_is_401_and_health_stays_open(node: dict[str, Any]) -> None:
    url = node["url"]
    for method, path in (("GET", "/load"), ("GET", "/v1/models"), ("GET", "/prefix/events")):
        r = httpx.request(method, url + path)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_node_token"
        assert TOKEN not in r.text
    r = httpx.post(url + "/v1/chat/completions", json=_chat(node["model"]))
    assert r.status_code == 401
    assert httpx.get(url + "/load", headers={"x-edgecloud-node-token": "x" * 32}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    ok = {"x-edgecloud-node-token": TOKEN}
    assert httpx.get(url + "/load", headers=ok).status_code == 200
    bearer = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(url + f"/tokenizer/{node['model']}", headers=bearer).status_code == 200


def test_gateway_with_the_token_works_end_to_end(node: dict[str, Any]) -> None:
    gw = _gateway(node)
    try:
        _wait_nodes(gw)
        for stream in (False, True):
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={**_chat(node["model"]), "stream": stream},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-edgecloud-node"] == "sec-cloud"
        # blind cross-site POSTs (text/plain) stay refused
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            content=b'{"model": "auto", "messages": [{"role": "user", "content": "x"}]}',
            headers={"content-type": "text/plain"},
        )
        assert r.status_code == 415
    finally:
        gw.stop()


def test_route_hides_node_urls_unless_admin_and_is_rate_limited(node: dict[str, Any]) -> None:
    auth = {
        "salt": SALT,
        "keys": [{"name": "user", "key_hash": hash_key(USER, SALT), "rpm": 2}],
        "admin_keys": [{"name": "ops", "key_hash": hash_key(ADMIN, SALT)}],
    }
    gw = _gateway(node, auth=AuthConfig.model_validate(auth))
    admin = {"authorization": f"Bearer {ADMIN}"}
    user = {"authorization": f"Bearer {USER}"}
    try:
        _wait_nodes(gw, admin)
        body = _chat(node["model"])
        r = httpx.post(gw.url + "/v1/route", json=body, headers=admin, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["url"] == node["url"] and r.json()["candidates"][0]["url"]
        r = httpx.post(gw.url + "/v1/route", json=body, headers=user, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        assert "url" not in out and all("url" not in c for c in out["candidates"])
        assert node["url"] not in r.text and out["node"] == "sec-cloud"
        assert httpx.post(gw.url + "/v1/route", json=body, headers=user).status_code == 200
        limited = httpx.post(gw.url + "/v1/route", json=body, headers=user)
        assert limited.status_code == 429  # 2 rpm: the third is refused
        assert httpx.post(gw.url + "/v1/route", json=body).status_code == 401
        # admin routes need the admin key, even from loopback
        assert httpx.get(gw.url + "/admin/nodes", headers=user).status_code == 401
    finally:
        gw.stop()


def test_auth_off_is_local_only_for_admin_and_urls(node: dict[str, Any]) -> None:
    gw = _gateway(node, observability="loopback")
    proxied = {"x-forwarded-for": "203.0.113.7"}
    try:
        _wait_nodes(gw)
        body = _chat(node["model"])
        assert "url" in httpx.post(gw.url + "/v1/route", json=body, timeout=30).json()
        r = httpx.post(gw.url + "/v1/route", json=body, headers=proxied, timeout=30)
        assert r.status_code == 200 and "url" not in r.json()
        r = httpx.get(gw.url + "/admin/nodes", headers=proxied)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_loopback_only"
        assert httpx.get(gw.url + "/metrics").status_code == 200
        assert httpx.get(gw.url + "/metrics", headers=proxied).status_code == 403
        assert httpx.get(gw.url + "/health", headers=proxied).status_code == 403
    finally:
        gw.stop()
    gw = _gateway(node, observability="open")
    try:
        assert httpx.get(gw.url + "/health", headers=proxied).json().keys() == {"status"}
        assert "store" in httpx.get(gw.url + "/health").json()
    finally:
        gw.stop()


# ---- start-up refusals ---------------------------------------------------------------------------
def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [*cli(*args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EDGECLOUD_NODE_TOKEN": "", **(env or {})},
    )


def test_open_gateway_on_a_public_address_refuses_to_start() -> None:
    r = _run("gateway", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "refusing to serve on 0.0.0.0 with authentication off" in r.stderr
    assert "--insecure-no-auth" in r.stderr and "Traceback" not in r.stderr


def test_node_on_a_public_address_without_a_token_refuses_to_start() -> None:
    r = _run("edge", "serve", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "without a node token" in r.stderr and "Traceback" not in r.stderr
    r = _run("edge", "serve", "--node-token", "short", "--port", "0")
    assert r.returncode == 2 and "node token is too weak" in r.stderr
    assert "at least 16 characters" in r.stderr
    r = _run("edge", "serve", "--node-token", "passwordpassword", "--port", "0")
    assert r.returncode == 2 and "node token is too weak" in r.stderr, r.stderr


def test_weak_admin_key_and_salt_are_refused(tmp_path: Path) -> None:
    weak = {"salt": SALT, "admin_keys": [{"name": "ops", "key_hash": hash_key("admin", SALT)}]}
    with pytest.raises(ValueError, match="well-known weak key"):
        AuthConfig.model_validate(weak)
    short = {"salt": "salt", "keys": [{"name": "u", "key_hash": hash_key(USER, "salt")}]}
    with pytest.raises(ValueError, match=r"auth\.salt is too weak: it must have at least 16"):
        AuthConfig.model_validate(short)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"auth:\n  salt: {SALT}\n  admin_keys:\n"
        f"    - {{name: ops, key_hash: '{hash_key('admin', SALT)}'}}\n"
    )
    r = _run("gateway", "--config", str(cfg), "--port", "0")
    assert r.returncode == 2 and "well-known weak key" in r.stderr, r.stderr
