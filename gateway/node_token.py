"""The node token a gateway sends to its nodes, and the middleware by which nodes require it.

Invariants:
- Nodes given a token (``--node-token``/``$EDGECLOUD_NODE_TOKEN``) answer 401 to any request
  without it in ``X-Edgecloud-Node-Token`` (or ``Authorization: Bearer``), except
  ``GET /health`` (liveness); compared with :func:`secrets.compare_digest`, never logged or
  echoed.
- A weak token is refused when the middleware is built (:func:`check_node_token`).
"""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.secret_strength import check_node_token

NODE_TOKEN_ENV = "EDGECLOUD_NODE_TOKEN"
NODE_TOKEN_HEADER = "x-edgecloud-node-token"


class NodeTokenMiddleware:
    """ASGI middleware of a node: every HTTP request but ``GET /health`` must carry the node
    token (``X-Edgecloud-Node-Token: <token>`` or ``Authorization: Bearer <token>``), else it
    gets an OpenAI-shaped 401 (``code: invalid_node_token``). Constant-time comparison; the
    token is never logged or echoed."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = check_node_token(token).encode()
        self._bearer = b"bearer " + self._token

    def _ok(self, scope: Scope) -> bool:
        ok = False
        for name, value in scope.get("headers") or ():
            if name == NODE_TOKEN_HEADER.encode():
                ok |= secrets.compare_digest(value, self._token)
            elif name == b"authorization":
                v = value.strip()
                ok |= secrets.compare_digest(v[:7].lower() + v[7:], self._bearer)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or (scope.get("method") == "GET" and scope.get("path") == "/health")
            or self._ok(scope)
        ):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "This node needs the node token (X-Edgecloud-Node-Token).",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_node_token",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
