"""The request path before a dispatch: parse, place the client, profile the prompt, decide.

Per request: the body as JSON and its validated model -> the client's region -> the model's
identity and tokenizer (cached by identity) -> the profile (prompt ids, block hashes) -> ONE
fleet view -> the decision.

Invariants:
- The hot path reads the fleet store once for the profile's blocks (``view``); an identity
  or tokenizer not known yet costs one more read, once per model.
- Nothing a client sends produces a 5xx here: a bad body is a 4xx naming its field (415 for
  a body not declared JSON, 400 ``invalid_json``, 422 from the schema), an unknown model 404,
  a prompt too long for every node 400; 503 only when no node can serve at all.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.circuit import CircuitBreakers
from gateway.client_ip import ClientIPResolver
from gateway.errors import APIError, bad_request, not_found_model
from gateway.front import fastjson
from gateway.front.tokenizers import TokenizerCache, TokenizerUnavailable
from gateway.geo import GeoLocator, GeoResult
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from routing.fleet.store import FleetStore, FleetView
from routing.policies import Decision, NoRoute
from routing.profile import RequestProfile, build_profile
from routing.prompt import TemplateError
from routing.request_body import ProfileError
from routing.router import Router


class ModelAliases:
    """Model names agents send (``claude-*``, ``gpt-*``) mapped to a served or virtual model.

    Patterns are shell patterns (:mod:`fnmatch`, case-sensitive); an exact name wins over
    patterns, then the first pattern in the configured order. Lookups are cached."""

    def __init__(self, table: dict[str, str]) -> None:
        self.exact = {k: v for k, v in table.items() if not any(c in k for c in "*?[")}
        self.patterns = [(k, v) for k, v in table.items() if k not in self.exact]
        self._cache: dict[str, str | None] = {}

    def target(self, name: str) -> str | None:
        if name in self.exact:
            return self.exact[name]
        if not self.patterns:
            return None
        if name not in self._cache:
            if len(self._cache) >= 4096:
                self._cache.clear()
            self._cache[name] = next(
                (v for k, v in self.patterns if fnmatch.fnmatchcase(name, k)), None
            )
        return self._cache[name]


OpenAIRequest = ChatCompletionRequest | CompletionRequest
RequestModel = type[ChatCompletionRequest] | type[CompletionRequest]

_OFFLOAD_CHARS = 2000  # prompts longer than this are tokenized in a worker thread


def request_id() -> str:
    """A new request id: what ``uuid.uuid4().hex`` gives (random, version 4), made directly."""
    n = int.from_bytes(os.urandom(16), "big")
    n = (n & ~(0xC000 << 48)) | (0x8000 << 48)  # the RFC 4122 variant
    n = (n & ~(0xF000 << 64)) | (4 << 76)  # version 4
    return f"{n:032x}"


def prompt_chars(body: dict[str, Any]) -> int:
    """About how many characters the prompt has (text parts; a token id counts as 4)."""
    n = 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                n += len(text) if isinstance(text, str) else 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        n += len(prompt)
    elif isinstance(prompt, list):
        n += sum(len(p) if isinstance(p, str) else 4 for p in prompt)
    return n


def parse_json(
    raw: bytes,
    model_cls: RequestModel,
    content_type: str | bytes | None = fastjson.JSON_CONTENT_TYPE,
) -> tuple[dict[str, Any], OpenAIRequest, bool]:
    """The body as JSON, its validated model, and whether orjson parsed it (see
    :mod:`gateway.front.fastjson`). ``content_type`` is the request's Content-Type header
    (None: absent): a body not declared JSON is a 415 (``gateway.json_limits``); the
    default is for callers that checked it already. Nesting deeper than
    ``gateway.json_limits.MAX_DEPTH`` is a 400 ``invalid_json``."""
    try:
        data, strict = fastjson.loads_request(raw, content_type)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return data, model_cls.model_validate(data), strict
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None


def no_nodes(poll_errors: dict[str, str] | None) -> APIError:
    """The 503 for a fleet view without nodes: configured nodes that do not answer (each URL
    with its last error: refused, TLS handshake failed, ...), else none registered at all."""
    if poll_errors:
        failing = "; ".join(f"{url}: {why}" for url, why in list(poll_errors.items())[:4])
        return APIError(
            503,
            f"No configured node can be reached ({failing}).",
            type_="server_error",
            code="nodes_unreachable",
            headers={"Retry-After": "1"},
        )
    return APIError(
        503,
        "No node is registered with this gateway, so no model can be served; the "
        "operator must configure nodes (nodes, openai_nodes or a redis_url fleet).",
        type_="server_error",
        code="no_nodes",
    )


class RequestPath:
    """Profiles and decides requests for one gateway (its store, tokenizers and router)."""

    def __init__(
        self,
        store: FleetStore,
        tokenizers: TokenizerCache,
        router: Router,
        breakers: CircuitBreakers,
        geo: GeoLocator,
        client_ip: ClientIPResolver,
        virtual_models: dict[str, str],
        model_aliases: dict[str, str] | None = None,
    ) -> None:
        self.store = store
        self.tokenizers = tokenizers
        self.router = router
        self.breakers = breakers
        self.geo = geo
        self.client_ip = client_ip
        self.virtual_models = virtual_models
        self.model_aliases = ModelAliases(model_aliases or {})
        self.identities: dict[str, str] = {}  # model name -> identity, from the last view
        self.policy_override: str | None = None
        self._peer_geo: dict[Any, GeoResult] = {}  # socket peer -> where (no trusted proxies)

    def client_region(self, request: Request) -> str:
        """The client's region; clients geo cannot place get the routing policy's default."""
        scope = request.scope
        if self.client_ip.trusted:  # X-Forwarded-For counts: the address depends on headers
            found = self.geo.locate(self.client_ip.from_scope(scope))
        else:  # the peer alone says where the client is: remember what each peer resolved to
            peer_info = scope.get("client")
            peer = peer_info[0] if peer_info else None
            found = self._peer_geo.get(peer)
            if found is None:
                found = self.geo.locate(self.client_ip.from_scope(scope))
                if len(self._peer_geo) >= 4096:
                    self._peer_geo.clear()
                self._peer_geo[peer] = found
        return found.region if found.source != "default" else self.router.config.default_region

    def concrete_model(self, requested: str) -> str:
        """The served model for a requested name: a virtual model's target, else an alias's
        (which may itself name a virtual model), else the name itself."""
        found = self.virtual_models.get(requested)
        if found is not None:
            return found
        aliased = self.model_aliases.target(requested)
        if aliased is None:
            return requested
        return self.virtual_models.get(aliased, aliased)

    # ---- profiling ---------------------------------------------------------------------------
    async def _identity(self, model: str) -> tuple[str, FleetView | None]:
        ident = self.identities.get(model)
        if ident is not None:
            return ident, None
        view = await self.store.view([])
        self.learn_identities(view)
        ident = self.identities.get(model)
        if ident is None:
            if any(model in n.models for n in view.nodes):
                return model, view  # a node with no identity (openai kind): name is the identity
            if not view.nodes:  # not the model's fault: nothing is registered, or answers
                raise no_nodes(getattr(self.store, "poll_errors", None))
            raise self._not_found(model, view)
        return ident, view

    def _not_found(self, model: str, view: FleetView) -> APIError:
        """The 404 for ``model``, naming what this gateway serves (virtual models and the
        fleet's models)."""
        served = [*self.virtual_models, *(m for n in view.nodes for m in n.models)]
        return not_found_model(model, served, aliases_hint=True)

    def learn_identities(self, view: FleetView) -> None:
        for n in view.nodes:
            for name, ident in n.model_identities.items():
                self.identities[name] = ident

    async def profile(
        self,
        body: dict[str, Any],
        route: str,
        model: str,
        region: str,
        api_key: str | None,
        cache_salt: str = "",
    ) -> tuple[RequestProfile, FleetView]:
        """The request's profile (block hashes in cache scope ``cache_salt``) and the one
        fleet view for them."""
        for _ in range(2):  # a second pass only when the model's identity changed under us
            ident, view0 = await self._identity(model)
            fmt = self.tokenizers.cached(ident)
            if fmt is None:
                nodes = (view0 or await self.store.view([])).nodes
                try:
                    fmt = await self.tokenizers.get(model, ident, nodes)
                except TokenizerUnavailable as exc:
                    raise APIError(
                        503, str(exc), type_="server_error", code="tokenizer_unavailable"
                    ) from exc

            build: Callable[[], RequestProfile] = functools.partial(
                build_profile,
                body,
                fmt,
                model=model,
                model_identity=ident,
                route=route,
                client_region=region,
                outputs=self.router.outputs,
                api_key=api_key,
                cache_salt=cache_salt,
            )
            try:
                big = prompt_chars(body) > _OFFLOAD_CHARS
                prof = await anyio.to_thread.run_sync(build) if big else build()
            except (ProfileError, TemplateError) as exc:
                raise bad_request(
                    str(exc), param="messages" if route == "chat" else "prompt"
                ) from exc
            view = await self.store.view(prof.block_hashes)
            self.learn_identities(view)
            if self.identities.get(model, ident) == ident:
                return prof, view
            self.identities.pop(model, None)
        return prof, view

    # ---- deciding ----------------------------------------------------------------------------
    def decide(self, prof: RequestProfile, view: FleetView) -> Decision:
        self.router.reload_if_changed()  # a stat() at most once a second: hot reload of the YAML
        try:
            return self.router.decide(
                prof, view, exclude=self.breakers.open_nodes(), policy=self.policy_override
            )
        except NoRoute as exc:
            if exc.code == "unknown_model" and view.nodes:
                raise self._not_found(prof.model, view) from exc
            if exc.code == "unsupported":
                raise bad_request(
                    str(exc), param=exc.param or "logprobs", code="unsupported_parameter"
                ) from exc
            if exc.code == "too_long":
                raise bad_request(
                    str(exc), param="max_tokens", code="context_length_exceeded"
                ) from exc
            raise APIError(
                503,
                str(exc),
                type_="server_error",
                code="no_node_available",
                headers={"Retry-After": "1"},
            ) from exc
