"""The gateway's probes on their own endpoints (gateway.front.probes), over real HTTP."""

from __future__ import annotations

import httpx

from tests.conftest import free_port
from tests.nodes import Served


def test_a_gateway_with_no_node_is_alive_started_and_not_ready() -> None:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gw = Served(create_gateway_app(GatewayConfig(nodes=[dead], poll_interval_s=0.2)))
    try:
        assert httpx.get(gw.url + "/livez").json() == {"status": "alive"}
        assert httpx.get(gw.url + "/startupz").status_code == 200  # the in-process store polled
        r = httpx.get(gw.url + "/readyz")
        assert r.status_code == 503 and r.json()["status"] == "no fresh node", r.text
        assert dead not in r.text
    finally:
        gw.stop()
