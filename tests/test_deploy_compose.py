"""deploy/compose.yaml run for real, without containers (tests.compose_local): Redis, two
gateways, an edge node in eu-west and one in us-east, a CPU cloud node in us-east, each started
from its service's command through the images' entrypoint, each waited for by its own
healthcheck; then a request through each gateway from a client in each region (placed by the
MaxMind test database through the trusted X-Forwarded-For) reaches a node of that region.
nginx is left out (its binary is not installed here; the requests go to each gateway with the
X-Forwarded-For that nginx would add)."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest

from tests.compose_local import LocalCompose
from tests.conftest import SHARED_DATA

GEO_DB = SHARED_DATA / "geoip" / "GeoLite2-City-Test.mmdb"
CLIENTS = {"eu-west": "81.2.69.142", "us-east": "216.160.83.56"}  # London; Milton, WA
NODE_REGION = {"edge-eu-west": "eu-west", "edge-us-east": "us-east", "cloud-us-east": "us-east"}


@pytest.fixture(scope="module")
def compose(tiny_model_path: Path, tiny_home: dict[str, str], tmp_path_factory):
    if not GEO_DB.exists():
        pytest.skip(f"MaxMind test database not found at {GEO_DB}")
    env = {
        **tiny_home,
        "EDGECLOUD_NODE_TOKEN": secrets.token_urlsafe(32),
        "EDGECLOUD_REDIS_PASSWORD": secrets.token_urlsafe(16),
        "EDGECLOUD_GEOIP_DB": str(GEO_DB),
        "EDGECLOUD_MODEL": str(tiny_model_path),
        "EDGECLOUD_EDGE_VARIANT": "fp32",  # "auto" runs the two-minute quality gate
    }
    project = LocalCompose(tmp_path_factory.mktemp("compose"), env, skip={"nginx"})
    try:
        project.up(timeout=300)
        yield project
    finally:
        codes = project.stop()
        assert all(c == 0 for c in codes.values()), codes


def test_compose_services_run_as_processes_and_route_by_region(compose: LocalCompose) -> None:
    for gateway in ("gateway-1", "gateway-2"):
        url = compose.url(gateway)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        name = next(m["id"] for m in model if m["id"] != "auto")
        for region, ip in CLIENTS.items():
            body = {"model": name, "messages": [{"role": "user", "content": "Hi"}]}
            body["max_tokens"] = 4
            r = httpx.post(
                url + "/v1/chat/completions",
                json=body,
                headers={"x-forwarded-for": ip},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            node = r.headers["x-edgecloud-node"]
            assert NODE_REGION[node] == region, (gateway, region, node, dict(r.headers))
