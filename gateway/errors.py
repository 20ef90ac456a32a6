"""OpenAI-shaped errors for every failure a client can cause or meet.

Invariant: a client mistake is a 4xx with ``{"error": {"message", "type", "param", "code"}}``;
nothing a client sends can produce a 500. A validation error names the field in ``param`` as a
dotted path (``messages.0.content``), without pydantic's union-member tags; its ``code`` is
``unsupported_parameter`` for a field we cannot honour, else ``invalid_value``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# pydantic error types with an OpenAI error code of their own (else "invalid_value")
_CODES = {"unsupported_parameter": "unsupported_parameter"}


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# 5xx codes whose messages name nodes or upstream errors: what the client is told instead
_GENERIC_5XX = {
    "upstream_unavailable": "No node could serve the request right now; please retry.",
    "tokenizer_unavailable": "The model's tokenizer cannot be fetched right now; please retry.",
    "upstream_error": "The node failed while answering; please retry.",
}


def public_error(request: Request, exc: APIError) -> APIError:
    """``exc`` as the client may see it: 5xx bodies say what failed, never where (node ids,
    URLs and upstream errors go to the log; the client gets the code and a generic message)."""
    generic = _GENERIC_5XX.get(exc.code or "") if exc.status >= 500 else None
    if generic is None:
        return exc
    log.warning("%s %s %s: %s", request.method, request.url.path, exc.code, exc.message)
    return APIError(exc.status, generic, exc.type, exc.param, exc.code, exc.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found_model(model: str, served: Iterable[str] = (), aliases_hint: bool = False) -> APIError:
    """404 for a model no node serves; ``served``: the names that would have been accepted,
    listed in the message; ``aliases_hint``: say how a gateway maps other names to them."""
    message = f"The model '{model}' does not exist"
    names = sorted(set(served))
    if names:
        message += f"; served here: {', '.join(names)}"
    if aliases_hint:
        message += " (model_aliases in the gateway config maps other names, e.g. 'claude-*')"
    return APIError(404, message, param="model", code="model_not_found")


def too_many_requests(message: str, retry_after_s: float) -> APIError:
    secs = max(1, int(retry_after_s + 0.999))
    return APIError(
        429,
        message,
        type_="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(secs)},
    )


# pydantic names the member of a union that failed in the error's location ("str",
# "list[TextPart]", "TextPart", "function-after[...]"): not a field, so not in the param
_UNION_TAG = re.compile(r"^(str|int|bool|float|bytes|none)$|[\[\]\-]|^[A-Z]")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and _UNION_TAG.search(p) is not None)
    ]
    return ".".join(parts) or None


def _most_specific(errors: list[Any]) -> Any:
    """The first error, or, where a union's members failed in turn, the deepest error under
    the same field (``content`` failing as text and as parts: the part's own error)."""
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ()))) or ""
    best, depth = first, len(param)
    for e in errors[1:]:
        p = _loc_to_param(tuple(e.get("loc", ()))) or ""
        if len(p) > depth and (not param or p.startswith(param + ".")):
            best, depth = e, len(p)
    return best


def _message(error: Any) -> str:
    msg = str(error.get("msg", "invalid request"))
    return msg.removeprefix("Value error, ")


def validation_error(errors: list[Any]) -> APIError:
    """The 400 for pydantic's ``errors`` (locations under ``body``): the most specific one's
    field as ``param``, ``invalid_json`` for a body that is not JSON."""
    first = _most_specific(errors) if errors else {}
    if first.get("type") == "json_invalid":
        return bad_request("We could not parse the JSON body of your request.", code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = _message(first)
    code = _CODES.get(str(first.get("type")), "invalid_value")
    text = f"Invalid value for '{param}': {msg}" if param and code == "invalid_value" else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error(s))"
    return bad_request(text, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(
            exc.status_code, str(exc.detail), type_=type_, headers=dict(exc.headers or {})
        ).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return bad_request(
            f"We could not parse the JSON body of your request: {exc.msg}", code="invalid_json"
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, "internal error", type_="server_error").response()
