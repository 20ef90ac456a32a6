"""The gateway's API documentation: ``/openapi.json``, ``/docs`` (Swagger UI), ``/redoc`` and
the ``/`` pointer, without touching the request path.

- The two hot routes (``POST /v1/chat/completions``, ``POST /v1/completions``) are served by
  :class:`gateway.front.app.GatewayApp` before any router; they are documented from
  *documentation-only* FastAPI routes (:data:`DOC_ROUTES`) that are added to the schema by
  :func:`install_docs`'s ``openapi()`` override and never to the router, so no request ever
  goes through FastAPI's dependency machinery for them.
- Response bodies are documented with ``responses=`` (schema only: FastAPI does not validate
  or re-serialize what a route returns, as ``response_model`` would).
- Swagger UI and ReDoc load their JavaScript from the ``fastapi-offline`` package's static
  files, served under ``/docs-assets`` (a gateway often has no internet); without that package
  they fall back to FastAPI's CDN defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, Usage

ASSETS_URL = "/docs-assets"
DESCRIPTION = (
    "An OpenAI-compatible endpoint in front of edge (ONNX Runtime) and cloud (torch) nodes. "
    "Point an OpenAI client at `/v1`; the model `auto` lets the gateway pick. Requests carry "
    "`Authorization: Bearer <key>` when the gateway has keys configured; admin routes need an "
    'admin key. Errors have OpenAI\'s shape: `{"error": {message, type, param, code}}`.'
)

# ---------------------------------------------------------------------------- response models


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong, for a person")
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error, ...")
    param: str | None = Field(default=None, description="the request field at fault")
    code: str | None = Field(default=None, description="machine-readable code")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text (`bytes:\\xNN` when not UTF-8 alone)")
    logprob: float = Field(description="log-softmax of the model's raw logits (no temperature)")
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` most likely, sorted")


class ChatLogprobs(BaseModel):
    """With ``logprobs: true``: one entry per generated token."""

    content: list[TokenLogprobEntry]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """With ``logprobs: k``: one position per token (with ``echo``, the prompt's first, whose
    logprob is null); ``top_logprobs`` maps the k most likely and the chosen token's text to
    their logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    """A non-streamed chat answer (``stream: false``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(description="Unix seconds")
    model: str = Field(description="the concrete model that answered (not `auto`)")
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = Field(default=0, description="the choice (of `n`) this chunk belongs to")
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat answer (``stream: true``): ``data: {...}``
    lines, ended by ``data: [DONE]``; with ``stream_options.include_usage`` a last chunk with
    empty ``choices`` carries ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """A text completion; streamed, each event is one of these with a piece of ``text``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "edgecloud"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """``status`` for everyone; the details (store, circuits, in-flight, streams, policy) for
    loopback or admin callers only (see the gateway's ``observability`` setting)."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "degraded"]
    store: dict[str, Any] | None = None
    circuits: dict[str, Any] | None = None
    in_flight: int | None = None
    streams: dict[str, int] | None = None
    policy: str | None = None
    policy_reload_error: str | None = None


class RouteCandidate(BaseModel):
    model_config = ConfigDict(extra="allow")

    node: str | None = Field(default=None, description="node id")
    url: str | None = Field(default=None, description="admins only")


class RouteDecision(BaseModel):
    """Where the request would go and why (the router's decision), without running it."""

    model_config = ConfigDict(extra="allow")

    url: str | None = Field(default=None, description="the chosen node's URL (admins only)")
    candidates: list[RouteCandidate] = Field(default_factory=list)


class NodesView(BaseModel):
    model_config = ConfigDict(extra="allow")

    stale: bool
    nodes: list[dict[str, Any]]
    circuits: dict[str, Any]
    latency_model: dict[str, Any]
    prediction_errors: dict[str, Any]
    in_flight: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="rows in flight per node: this worker's (here) and the other workers' "
        "(other_workers, with --workers N)",
    )
    worker: dict[str, Any] | None = Field(
        default=None, description="which worker answered (index, of, pid), with --workers N"
    )


class PolicyView(BaseModel):
    active: str = Field(description="the policy in use")
    config: dict[str, Any] | None = Field(default=None, description="the policy YAML's values")


class PolicyChange(BaseModel):
    policy: str | None = Field(
        default=None,
        description="latency, threshold, round_robin, least_loaded, edge_first, "
        "cloud_only; null: back to the policy file's",
    )


class Pointer(BaseModel):
    name: str
    api: str = Field(description="the OpenAI-compatible base URL path")
    docs: str
    openapi: str


# -------------------------------------------------------------------------- the responses= maps

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the request is invalid"},
    401: {"model": ErrorResponse, "description": "missing or unknown API key"},
    429: {"model": ErrorResponse, "description": "rate limit or queue full (Retry-After)"},
}
_UPSTREAM: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "request body over the limit"},
    503: {"model": ErrorResponse, "description": "no node could serve it (retry)"},
}


def _stream_response(model: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": f"{what}; with `stream: true`, `text/event-stream` of chunks",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **_ERRORS,
        **_UPSTREAM,
    }


CHAT_RESPONSES = _stream_response(ChatCompletion, "the answer")
COMPLETION_RESPONSES = _stream_response(Completion, "the completion")
MODELS_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"model": ModelList}, **_ERRORS}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Health},
    403: {"model": ErrorResponse, "description": "observability mode forbids this caller"},
}
ROUTE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": RouteDecision},
    **_ERRORS,
    **_UPSTREAM,
}
ROUTE_BODY: dict[str, Any] = {  # /v1/route takes either request body (it reads the raw bytes)
    "requestBody": {
        "required": True,
        "description": "a chat or completion request: where it would go, without running it",
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {"$ref": "#/components/schemas/ChatCompletionRequest"},
                        {"$ref": "#/components/schemas/CompletionRequest"},
                    ]
                }
            }
        },
    }
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    403: {"model": ErrorResponse, "description": "observability mode forbids this caller"},
}
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or unknown admin key"},
    403: {"model": ErrorResponse, "description": "not an admin key"},
}

# --------------------------------------------------------------- documentation-only routes

DOC_ROUTES = APIRouter()


@DOC_ROUTES.post(
    "/v1/chat/completions",
    tags=["OpenAI"],
    summary="Create a chat completion",
    responses=CHAT_RESPONSES,
)
async def chat_completions(body: ChatCompletionRequest) -> None:  # pragma: no cover
    """OpenAI's chat completions: `messages` in, the assistant's answer out, streamed as
    server-sent events with `stream: true`. The model `auto` (or any virtual model) lets the
    gateway choose the node; a concrete model name is served by a node that has it."""


@DOC_ROUTES.post(
    "/v1/completions",
    tags=["OpenAI"],
    summary="Create a text completion",
    responses=COMPLETION_RESPONSES,
)
async def completions(body: CompletionRequest) -> None:  # pragma: no cover
    """OpenAI's (legacy) completions: a `prompt` string or a list of token ids in, text out."""


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The schema of ``app``'s routes plus the documentation-only hot routes (first)."""
    return get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=[*DOC_ROUTES.routes, *app.routes],
        tags=[
            {"name": "OpenAI", "description": "the OpenAI-compatible API"},
            {"name": "Gateway", "description": "routing, health and metrics"},
            {"name": "Admin", "description": "admin key only"},
        ],
    )


def _static_dir() -> Path | None:
    try:
        import fastapi_offline
    except ImportError:
        return None
    folder = Path(fastapi_offline.__file__).parent / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def install_docs(app: FastAPI) -> None:
    """``/openapi.json``, ``/docs``, ``/redoc``, ``/`` (and the docs' static files) on ``app``
    (created with ``docs_url=None, redoc_url=None``)."""
    app.description = DESCRIPTION
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "schema" not in cache:
            cache["schema"] = openapi_schema(app)
        return cache["schema"]

    app.openapi = openapi  # type: ignore[method-assign]
    static = _static_dir()
    swagger: dict[str, str] = {}
    redoc: dict[str, str] = {}
    if static is not None:
        from fastapi.staticfiles import StaticFiles

        app.mount(ASSETS_URL, StaticFiles(directory=static), name="docs-assets")
        swagger = {
            "swagger_js_url": f"{ASSETS_URL}/swagger-ui-bundle.js",
            "swagger_css_url": f"{ASSETS_URL}/swagger-ui.css",
            "swagger_favicon_url": f"{ASSETS_URL}/favicon.png",
        }
        redoc = {
            "redoc_js_url": f"{ASSETS_URL}/redoc.standalone.js",
            "redoc_favicon_url": f"{ASSETS_URL}/favicon.png",
        }
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} - API docs", **swagger
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc_page() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            with_google_fonts=not redoc,  # offline: no fonts from a CDN either
            **redoc,
        )

    @app.get("/", tags=["Gateway"], summary="Where things are", responses={200: {"model": Pointer}})
    async def root() -> JSONResponse:
        return JSONResponse(
            {"name": app.title, "api": "/v1", "docs": "/docs", "openapi": openapi_url}
        )
