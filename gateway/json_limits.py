"""Limits on JSON request bodies, shared by the front gateway and the node app.

Invariants:
- A JSON document nested deeper than :data:`MAX_DEPTH` (arrays and objects inside each other)
  is refused with :class:`JSONTooDeep` (a ``ValueError``: HTTP 400 ``invalid_json``), whoever
  parsed it: ``json`` would raise ``RecursionError`` near depth 1000 (a 500 once, and after
  it the kept-alive connection was closed), orjson refuses depth 1024 and its ``dumps`` 255,
  pydantic and jinja2 recurse too. No OpenAI request needs more than a handful of levels.
- The checks never recurse: they walk with an explicit stack.
- Only a ``application/json`` body (any parameters, e.g. ``; charset=utf-8``) is parsed; a
  POST with another content type, or none, and a non-empty body is refused with a 415 before
  it is parsed (:func:`check_content_type`). A ``text/plain`` or form body is what a web page
  can send to any origin without a CORS preflight; the official ``openai`` SDKs always send
  ``application/json``. An empty body without a content type is left to the JSON parser
  (a 400 ``invalid_json``).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

MAX_DEPTH = 64


class JSONTooDeep(ValueError):
    """The document nests arrays and objects deeper than :data:`MAX_DEPTH`."""


def may_be_too_deep(raw: bytes | str, limit: int = MAX_DEPTH) -> bool:
    """False when ``raw`` cannot nest deeper than ``limit``: it opens at most ``limit``
    arrays and objects in all (counted in C; brackets inside strings count too, which only
    makes the answer conservative)."""
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{") > limit
    return raw.count(b"[") + raw.count(b"{") > limit


def depth_exceeds(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether the parsed document ``obj`` nests containers deeper than ``limit`` (a scalar
    is depth 0, ``[]`` depth 1)."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        o, d = stack.pop()
        t = type(o)
        if t is dict:
            if d >= limit:
                return True
            stack.extend((v, d + 1) for v in o.values())
        elif t is list:
            if d >= limit:
                return True
            stack.extend((v, d + 1) for v in o)
    return False


def check_depth(raw: bytes | str, obj: Any, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`JSONTooDeep` if ``obj`` (parsed from ``raw``) nests deeper than ``limit``."""
    if may_be_too_deep(raw, limit) and depth_exceeds(obj, limit):
        raise JSONTooDeep(f"the JSON body nests arrays and objects deeper than {limit} levels")


def loads(raw: bytes | str, limit: int = MAX_DEPTH) -> Any:
    """``json.loads(raw)``, refusing documents nested deeper than ``limit`` with
    :class:`JSONTooDeep` (also where ``json`` itself would run out of recursion)."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise JSONTooDeep(
            f"the JSON body nests arrays and objects deeper than {limit} levels"
        ) from None
    check_depth(raw, obj, limit)
    return obj


def invalid_json(exc: Exception) -> APIError:
    """The 400 for a body that is not acceptable JSON (``exc`` from a parser or the checks)."""
    return bad_request(
        f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
    )


def is_json_media_type(content_type: str | bytes | None) -> bool:
    """Whether a Content-Type header value is ``application/json`` (parameters ignored)."""
    if content_type is None:
        return False
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    return content_type.partition(";")[0].strip().lower() == "application/json"


def check_content_type(content_type: str | bytes | None, body: bytes) -> None:
    """Raise the 415 for a body that is not declared ``application/json`` (see the module
    docstring: an empty body without a content type passes, to be refused as JSON)."""
    if is_json_media_type(content_type) or (content_type is None and not body):
        return
    if content_type is None:
        what = "The request has a body but no Content-Type"
    else:
        shown = content_type.decode("latin-1") if isinstance(content_type, bytes) else content_type
        what = f"Unsupported Content-Type {shown!r}"
    raise APIError(
        415,
        f"{what}: send the request body as JSON with 'Content-Type: application/json'.",
        code="unsupported_media_type",
    )


def validated_body(raw: bytes, content_type: str | bytes | None, model_cls: type[M]) -> M:
    """A request body checked and validated: a 415 unless it is declared JSON, a 400
    ``invalid_json`` unless it is a JSON object within :data:`MAX_DEPTH`, a
    ``RequestValidationError`` (a 400 naming the field) unless ``model_cls`` accepts it."""
    check_content_type(content_type, raw)
    try:
        data = loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, JSONTooDeep
        raise invalid_json(exc) from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None
