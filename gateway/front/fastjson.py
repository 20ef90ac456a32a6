"""JSON on the gateway's hot path: orjson where it gives the same answer as :mod:`json`.

- :func:`loads` returns what ``json.loads`` returns and raises what it raises: orjson parses
  the strict RFC 8259 JSON that requests are made of; anything it refuses (NaN, infinities,
  lone surrogates, other encodings, invalid documents) is handed to ``json.loads``, which
  accepts it or raises its own error, message included. orjson reads an integer beyond 64
  bits as a float where ``json`` keeps it exact: a document in which orjson found a number of
  that size (|x| >= 2**63) is parsed again by ``json``. One exception to "raises what
  ``json.loads`` raises": a document nested deeper than ``gateway.json_limits.MAX_DEPTH``
  raises ``JSONTooDeep`` (a ``ValueError``), whichever parser read it, where ``json`` would
  parse it or raise ``RecursionError``.
- :func:`dumps` serializes a document :func:`loads` parsed with orjson (``strict=True``) with
  orjson, else with ``json.dumps``. The bytes differ from ``json.dumps`` (compact, UTF-8
  rather than ``\\u`` escapes) but encode the same JSON value.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.json_limits import JSONTooDeep, check_content_type, check_depth

JSON_CONTENT_TYPE = "application/json"

try:
    import orjson
except ImportError:  # pragma: no cover - the standard library only, slower
    orjson = None  # type: ignore[assignment]


_BIG = 9.2e18  # below 2**63, the smallest magnitude of an integer orjson turns into a float


def _has_big_float(obj: Any) -> bool:
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict:
            stack.extend(o.values())
        elif t is list:
            stack.extend(o)
        elif t is float and not -_BIG < o < _BIG:
            return True
    return False


_REFUSED = object()


def _orjson_loads(raw: bytes | str) -> Any:
    """orjson's parse of ``raw``, or ``_REFUSED`` when orjson is missing or refuses it."""
    if orjson is None:
        return _REFUSED
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _REFUSED


def loads(raw: bytes | str) -> tuple[Any, bool]:
    """``(json.loads(raw), True if orjson parsed it)``; ``JSONTooDeep`` for deep nesting."""
    obj = _orjson_loads(raw)
    if obj is not _REFUSED and not _has_big_float(obj):
        check_depth(raw, obj)
        return obj, True
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise JSONTooDeep("the JSON body nests arrays and objects too deeply") from None
    check_depth(raw, obj)
    return obj, False


def loads_request(raw: bytes, content_type: str | bytes | None) -> tuple[Any, bool]:
    """:func:`loads` of a request body whose Content-Type header is ``content_type`` (None:
    absent): an ``APIError`` 415 unless it is JSON (``gateway.json_limits.check_content_type``)."""
    check_content_type(content_type, raw)
    return loads(raw)


def usage_of_response(raw: bytes) -> Any:
    """``json.loads(raw).get("usage") or {}`` (raising what that raises), looking at nothing
    but the usage object for numbers orjson may have read differently."""
    obj = _orjson_loads(raw)
    if obj is not _REFUSED:
        usage = obj.get("usage") or {}
        if not _has_big_float(usage):
            return usage
    return json.loads(raw).get("usage") or {}


def dumps(obj: Any, strict: bool) -> bytes:
    """``obj`` as JSON bytes (orjson when ``strict``: it came from :func:`loads` via orjson)."""
    if strict and orjson is not None:
        try:
            return orjson.dumps(obj)
        except (TypeError, orjson.JSONEncodeError):
            pass
    return json.dumps(obj).encode()
