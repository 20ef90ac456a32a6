"""TLS between gateways and nodes, with real certificates made here (trustme): a node serves
HTTPS from its TLS folder (client certificates required when it has a CA), a gateway reaches
it with its ``node_tls`` folder and gets an answer; without the CA, or without a client
certificate for a node that requires one, the node is unreachable and requests get a 503
naming why (never a 500); the node token is never sent over plain HTTP beyond loopback."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from gateway.commands.node_args import node_tls_from_env
from gateway.front.config import GatewayConfig
from gateway.front.http1_pool import H1Pool
from gateway.front.node_client import make_client
from gateway.front.plain_token_guard import PlainTokenGuard
from gateway.http_server import DrainingServer
from gateway.server_limits import ServerLimits
from gateway.tls_folder import TLSFolder, TLSFolderError, client_context, load_tls_folder
from tests.conftest import free_port

trustme = pytest.importorskip("trustme")

TOKEN = "Zq8-vT3kLw9xRb2NcYp7"  # a node token strong enough for check_node_token


# ---- certificates ------------------------------------------------------------------------------
def _write(folder: Path, cert: Any | None = None, ca: Any | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if cert is not None:
        (folder / "cert.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        (folder / "key.pem").write_bytes(cert.private_key_pem.bytes())
    if ca is not None:
        (folder / "ca.pem").write_bytes(ca.cert_pem.bytes())
    return folder


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders: ``node`` (server cert for 127.0.0.1, no CA: plain TLS), ``node_mtls`` (the same
    cert and the CA: client certificates required), ``gateway`` (the CA and a client cert),
    ``gateway_ca`` (the CA only), ``other_ca`` (a CA that signed nothing here)."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gateway.test")
    return {
        "node": _write(root / "node", cert=server),
        "node_mtls": _write(root / "node_mtls", cert=server, ca=ca),
        "gateway": _write(root / "gateway", cert=client, ca=ca),
        "gateway_ca": _write(root / "gateway_ca", ca=ca),
        "other_ca": _write(root / "other_ca", ca=other),
    }


# ---- an HTTPS server in a thread ---------------------------------------------------------------
def _echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {
            "token": request.headers.get("x-edgecloud-node-token"),
            "body": await request.body(),
        }

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    return app


class ServedTLS:
    """``app`` under :class:`DrainingServer` with ``tls`` on a free loopback port (a thread)."""

    def __init__(self, app: Any, tls: TLSFolder, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.server = DrainingServer(
            app, host="127.0.0.1", port=self.port, limits=ServerLimits(), tls=tls
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.request_stop("test over")
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def echo_nodes(pki: dict[str, Path]) -> Iterator[dict[str, ServedTLS]]:
    """The echo app over TLS (``tls``) and over mutual TLS (``mtls``)."""
    served = {
        "tls": ServedTLS(_echo_app(), load_tls_folder(pki["node"], server=True)),
        "mtls": ServedTLS(_echo_app(), load_tls_folder(pki["node_mtls"], server=True)),
    }
    yield served
    for s in served.values():
        s.stop()


# ---- the TLS folder ----------------------------------------------------------------------------
def test_a_tls_folder_is_checked_when_loaded(
    pki: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = load_tls_folder(pki["node_mtls"], server=True)
    assert node.mutual and node.server_options()["ssl_cert_reqs"] == 2  # ssl.CERT_REQUIRED
    assert not load_tls_folder(pki["node"], server=True).mutual
    assert load_tls_folder(pki["gateway_ca"], server=False).cert is None
    monkeypatch.setenv("EDGECLOUD_NODE_TLS", str(pki["gateway_ca"]))  # what edge/cloud serve read
    with pytest.raises(SystemExit) as stop:
        node_tls_from_env("edgecloud edge serve")
    assert stop.value.code == 2 and "a node needs cert.pem" in capsys.readouterr().err
    monkeypatch.setenv("EDGECLOUD_NODE_TLS", str(pki["node"]))
    assert node_tls_from_env("edgecloud edge serve") == load_tls_folder(pki["node"], server=True)
    with pytest.raises(TLSFolderError, match=r"a node needs cert\.pem"):
        load_tls_folder(pki["gateway_ca"], server=True)
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "cert.pem").write_bytes((pki["node"] / "cert.pem").read_bytes())
    with pytest.raises(TLSFolderError, match=r"key\.pem is missing"):
        load_tls_folder(lone, server=True)
    (lone / "key.pem").write_bytes(
        trustme.CA().issue_cert("127.0.0.1").private_key_pem.bytes()
    )  # another certificate's key
    with pytest.raises(TLSFolderError, match="do not load as a matching certificate and key"):
        load_tls_folder(lone, server=True)
    bad_ca = tmp_path / "bad_ca"
    bad_ca.mkdir()
    (bad_ca / "ca.pem").write_text("not a certificate\n")
    with pytest.raises(TLSFolderError, match=r"ca\.pem is not a PEM CA bundle"):
        load_tls_folder(bad_ca, server=False)
    with pytest.raises(ValueError, match="TLS folder"):  # the gateway's YAML checks it at load
        GatewayConfig(node_tls=tmp_path / "absent")


# ---- the gateway's HTTP/1 pool over TLS --------------------------------------------------------
async def _post(pool: H1Pool, url: str) -> tuple[int, bytes]:
    target = pool.target(url)
    assert target is not None
    resp = await pool.post(target, b"hello", {"x-edgecloud-node-token": TOKEN})
    return resp.status_code, await resp.aread()


async def test_the_pool_speaks_tls_and_verifies_the_node(
    pki: dict[str, Path], echo_nodes: dict[str, ServedTLS]
) -> None:
    trusted = client_context(load_tls_folder(pki["gateway_ca"], server=False))
    pool = H1Pool(ssl_context=trusted)
    try:
        url = echo_nodes["tls"].url + "/echo"
        for _ in range(2):  # the second on the kept-alive connection
            status, body = await _post(pool, url)
            assert status == 200 and b'"body":"hello"' in body
        assert len(pool._open) == 1
    finally:
        await pool.aclose()
    assert H1Pool().target(url) is None  # without a context https:// is not taken
    stranger = H1Pool(ssl_context=client_context(load_tls_folder(pki["other_ca"], server=False)))
    try:
        with pytest.raises(
            httpx.ConnectError, match=r"TLS handshake .* failed.*CERTIFICATE_VERIFY"
        ):
            await _post(stranger, url)
    finally:
        await stranger.aclose()


async def test_mutual_tls_refuses_a_gateway_without_a_client_certificate(
    pki: dict[str, Path], echo_nodes: dict[str, ServedTLS]
) -> None:
    url = echo_nodes["mtls"].url + "/echo"
    with_cert = make_client(tls=load_tls_folder(pki["gateway"], server=False))
    without = make_client(tls=load_tls_folder(pki["gateway_ca"], server=False))
    try:
        resp = await with_cert.post(url, b"hi", {})
        assert resp.status_code == 200 and b'"body":"hi"' in await resp.aread()
        assert (await with_cert.get(echo_nodes["mtls"].url + "/ping")).json() == {"ok": "yes"}
        with pytest.raises(httpx.TransportError, match=r"(?i)certificate"):
            resp = await without.post(url, b"hi", {})
            await resp.aread()
        with pytest.raises(httpx.TransportError):
            await without.get(echo_nodes["mtls"].url + "/ping")
    finally:
        await with_cert.aclose()
        await without.aclose()


# ---- the node token in clear ---------------------------------------------------------------------
def test_the_guard_refuses_the_token_in_clear_beyond_loopback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = PlainTokenGuard(has_token=True, allow_plain=False)
    for url in ("http://127.0.0.1:8001/x", "http://[::1]:8001/x", "http://localhost/x"):
        guard.check(url)  # loopback
    guard.check("https://10.0.0.5:8001/v1/completions")  # TLS
    with caplog.at_level(logging.WARNING, logger="gateway.front.plain_token_guard"):
        for path in ("/v1/completions", "/load", "/v1/completions"):
            with pytest.raises(httpx.ConnectError, match="refusing to send the node token"):
                guard.check("http://10.0.0.5:8001" + path)
        with pytest.raises(httpx.ConnectError):
            guard.check("http://edge.internal:8001/load")  # a host name may resolve anywhere
    refusals = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert [m.split(" (")[0].rsplit(" ", 1)[-1] for m in refusals] == [
        "http://10.0.0.5:8001",
        "http://edge.internal:8001",
    ]  # once per node, whatever the path
    assert len(guard.warnings()) == 2 and TOKEN not in " ".join(guard.warnings())
    PlainTokenGuard(has_token=False, allow_plain=False).check("http://10.0.0.5:8001/x")
    PlainTokenGuard(has_token=True, allow_plain=True).check("http://10.0.0.5:8001/x")


@pytest.fixture
async def plain_remote_gateway() -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A gateway with a node token and one node at a plain-HTTP address off loopback (an
    address from TEST-NET-1: nothing answers there, nothing may be sent there)."""
    from gateway.front.app import create_gateway_app

    cfg = GatewayConfig(nodes=["http://192.0.2.10:8001"], node_token=TOKEN)
    app = create_gateway_app(cfg)
    gw = app.state.gateway
    await gw.start()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield gw, client
    await gw.close()


async def test_a_plain_http_node_off_loopback_is_refused_by_the_gateway(
    plain_remote_gateway: tuple[Any, httpx.AsyncClient],
) -> None:
    gw, client = plain_remote_gateway
    sent: list[str] = []
    real_post = gw.client.transport.post

    async def spy(url: str, body: bytes, headers: dict[str, str]) -> Any:
        sent.append(url)
        return await real_post(url, body, headers)

    gw.client.transport.post = spy
    health = (await client.get("/health")).json()
    assert any(
        "refusing to send the node token in clear to http://192.0.2.10:8001" in w
        for w in health["warnings"]
    )
    assert "refusing" in health["store"]["poll_errors"]["http://192.0.2.10:8001"]
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "nodes_unreachable"
    assert "refusing to send the node token in clear" in r.json()["error"]["message"]
    with pytest.raises(httpx.ConnectError):  # and the node client itself sends nothing
        await gw.client.post("http://192.0.2.10:8001/v1/completions", b"{}", {})
    assert sent == []
    assert TOKEN not in r.text and TOKEN not in str(health)


# ---- a real node over HTTPS, a real gateway ------------------------------------------------------
@pytest.fixture(scope="module")
def https_node(
    pki: dict[str, Path], tiny_model_path: Path, tiny_home: dict[str, str]
) -> Iterator[ServedTLS]:
    """The real node app (tiny cloud engine) served over mutual TLS with the node token."""
    from gateway.node.app import create_node_app
    from gateway.node.server import build_service
    from routing.model_store import resolve
    from tests.nodes import tiny_cloud_engine

    tls = load_tls_folder(pki["node_mtls"], server=True)
    port = free_port()
    service = build_service(
        tiny_cloud_engine(tiny_model_path),
        resolve(tiny_model_path),
        region="test",
        host="127.0.0.1",
        port=port,
        node_id="cloud-tls",
        tls=True,
    )
    assert service.config.public_url == f"https://127.0.0.1:{port}"
    served = ServedTLS(create_node_app(service, None, node_token=TOKEN), tls, port)
    yield served
    served.stop()


async def _gateway(node_url: str, folder: Path | None) -> tuple[Any, Any, httpx.AsyncClient]:
    from gateway.front.app import create_gateway_app

    cfg = GatewayConfig(nodes=[node_url], node_token=TOKEN, node_tls=folder)
    app = create_gateway_app(cfg)
    gw = app.state.gateway
    await gw.start()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return app, gw, httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60)


async def test_a_gateway_reaches_an_https_node_with_the_ca_and_client_cert(
    pki: dict[str, Path], https_node: ServedTLS
) -> None:
    _, gw, client = await _gateway(https_node.url, pki["gateway"])
    try:
        view = await gw.store.view([])
        assert [n.id for n in view.nodes] == ["cloud-tls"]
        model = view.nodes[0].models[0]
        r = await client.post(
            "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-edgecloud-node"] == "cloud-tls"
        assert r.json()["usage"]["completion_tokens"] >= 1
        health = (await client.get("/health")).json()
        assert health["warnings"] == []
    finally:
        await client.aclose()
        await gw.close()


@pytest.mark.parametrize(
    ("folder", "why"),
    [("other_ca", "CERTIFICATE_VERIFY_FAILED"), ("gateway_ca", "(?i)certificate")],
    ids=["without-the-ca", "without-a-client-cert"],
)
async def test_a_node_the_gateway_cannot_reach_over_tls_is_a_clean_503(
    pki: dict[str, Path], https_node: ServedTLS, folder: str, why: str
) -> None:
    _, gw, client = await _gateway(https_node.url, pki[folder])
    try:
        assert (await gw.store.view([])).nodes == []  # unreachable: never in the view
        errors = (await client.get("/health")).json()["store"]["poll_errors"]
        assert list(errors) == [https_node.url]
        r = await client.post(
            "/v1/completions", json={"model": "auto", "prompt": "hello", "max_tokens": 2}
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "nodes_unreachable"
        assert https_node.url in r.json()["error"]["message"]
        assert re.search(why, errors[https_node.url]), errors
    finally:
        await client.aclose()
        await gw.close()
