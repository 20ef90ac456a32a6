"""/openapi.json documents every route with its request and response schemas (the two hot
routes too, which bypass the router); /docs and /redoc render from local files; / points
to them; documenting the hot routes did not put them back on FastAPI's router."""

from __future__ import annotations

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from gateway.front.app import create_gateway_app
from gateway.front.config import GatewayConfig

HOT = ("/v1/chat/completions", "/v1/completions")


def _client() -> TestClient:
    return TestClient(create_gateway_app(GatewayConfig(nodes=[], tune_gc=False)))


def test_every_route_is_in_the_spec_with_its_schemas() -> None:
    with _client() as c:
        app = c.app
        spec = c.get("/openapi.json").json()
        paths = spec["paths"]
        schemas = spec["components"]["schemas"]
        routes = [
            r
            for r in app.routes  # type: ignore[attr-defined]
            if isinstance(r, Route) and (not isinstance(r, APIRoute) or r.include_in_schema)
        ]
        served = {(r.path, m.lower()) for r in routes for m in (r.methods or ()) if m != "HEAD"}
        served -= {(p, "get") for p in ("/docs", "/redoc", "/openapi.json")}
        documented = {(p, m) for p, ops in paths.items() for m in ops}
        assert served <= documented, served - documented
        for path, method in documented:
            op = paths[path][method]
            assert op["responses"]["200"].get("content"), (path, method)
            if method == "post":
                assert op.get("requestBody"), (path, method)
        chat = paths["/v1/chat/completions"]["post"]
        body = chat["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/ChatCompletionRequest")
        ok = chat["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
        assert "text/event-stream" in ok
        comp = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
        assert comp["schema"]["$ref"].endswith("/CompletionRequest")
        for name in ("ChatCompletion", "ChatCompletionChunk", "Completion", "ErrorResponse"):
            assert name in schemas or name == "ChatCompletionChunk", name
        assert "messages" in schemas["ChatCompletionRequest"]["properties"]


def test_hot_routes_stay_off_fastapi_routing() -> None:
    app = create_gateway_app(GatewayConfig(nodes=[], tune_gc=False))
    for path in HOT:
        assert path in app.hot_routes  # type: ignore[attr-defined]
        on_router = [r for r in app.routes if getattr(r, "path", None) == path]
        assert on_router and not any(isinstance(r, APIRoute) for r in on_router), on_router


def test_docs_pages_use_local_assets_and_root_points_to_them() -> None:
    with _client() as c:
        root = c.get("/").json()
        assert root["docs"] == "/docs" and root["api"] == "/v1"
        for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
            html = c.get(page)
            assert html.status_code == 200 and f"/docs-assets/{asset}" in html.text
            assert "cdn.jsdelivr" not in html.text
            assert c.get(f"/docs-assets/{asset}").status_code == 200


def test_no_node_is_a_503_that_says_so() -> None:
    with _client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_nodes"
        assert "does not exist" not in r.text
