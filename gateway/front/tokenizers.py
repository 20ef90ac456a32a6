"""The gateway's tokenizers, fetched from the nodes that serve each model.

Invariants: the gateway holds no model files of its own. A model's tokenizer and chat template
come from ``GET /tokenizer/{model}`` on a node that serves it, are written under
``<home>/tokenizers/<identity>/`` and reused by identity: a node serving a changed model (new
identity) is fetched anew; concurrent first requests share one fetch.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

import httpx

from routing.fleet.state import NodeState
from routing.model_store import home_dir
from routing.prompt import TOKENIZER_FILES, PromptFormatter

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


class TokenizerUnavailable(LookupError):
    pass


class GatewayFormatter(PromptFormatter):
    """The model's formatter, tokenizing through the batch entry point of ``tokenizers``.

    Same token ids as ``PromptFormatter.encode``, but the batch call releases the GIL while
    the Rust code runs (the single-text ``encode`` holds it), so a long prompt tokenized in a
    worker thread does not stall the event loop; it also skips computing offsets, which the
    gateway never reads, and so costs less for short prompts too.
    """

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return batch([text], add_special_tokens=False)[0].ids


class TokenizerCache:
    def __init__(self, client: httpx.AsyncClient, root: Path | None = None) -> None:
        self.client = client
        self.root = root or home_dir() / "tokenizers"
        self._by_identity: dict[str, PromptFormatter] = {}
        self._pending: dict[str, asyncio.Future[PromptFormatter]] = {}

    def cached(self, identity: str) -> PromptFormatter | None:
        return self._by_identity.get(identity)

    async def get(self, model: str, identity: str, nodes: Iterable[NodeState]) -> PromptFormatter:
        hit = self._by_identity.get(identity)
        if hit is not None:
            return hit
        if not _SAFE.match(identity):
            raise TokenizerUnavailable(f"unsafe model identity {identity!r}")
        folder = self.root / identity
        if (folder / "tokenizer.json").is_file():
            fmt = GatewayFormatter.from_folder(folder)
            self._by_identity[identity] = fmt
            return fmt
        pending = self._pending.get(identity)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[PromptFormatter] = asyncio.get_running_loop().create_future()
        self._pending[identity] = fut
        try:
            fmt = await self._fetch(model, identity, list(nodes), folder)
            self._by_identity[identity] = fmt
            fut.set_result(fmt)
            return fmt
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._pending.pop(identity, None)

    async def _fetch(
        self, model: str, identity: str, nodes: list[NodeState], folder: Path
    ) -> PromptFormatter:
        errors = []
        for node in nodes:
            if node.model_identities.get(model, identity) != identity:
                continue
            try:
                resp = await self.client.get(
                    f"{node.url.rstrip('/')}/tokenizer/{model}", timeout=10.0
                )
                resp.raise_for_status()
                data = resp.json()
                if data.get("identity") != identity:
                    errors.append(f"{node.id}: serves identity {data.get('identity')}")
                    continue
                files = {k: v for k, v in data["files"].items() if k in TOKENIZER_FILES}
                if "tokenizer.json" not in files:
                    errors.append(f"{node.id}: no tokenizer.json")
                    continue
                return self._store(folder, files)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                errors.append(f"{node.id}: {exc}")
        raise TokenizerUnavailable(
            f"no node could give the tokenizer of {model!r}: {'; '.join(errors) or 'no nodes'}"
        )

    def _store(self, folder: Path, files: dict[str, str]) -> PromptFormatter:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
        for name, text in files.items():
            (tmp / name).write_text(text)
        fmt = GatewayFormatter.from_folder(tmp)  # verify before publishing
        try:
            os.replace(tmp, folder)
        except OSError:  # another process published it first: use theirs
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        return GatewayFormatter.from_folder(folder) if folder.is_dir() else fmt
