"""The gateway's own request log: one trace line per finished request, opt-in, no prompt text.

Each line is a :class:`routing.sim.trace.TraceRequest` (the simulator's trace format), so a
gateway's real traffic replays through ``edgecloud sim`` and ``edgecloud tune`` as it came:
arrival time (wall clock, seconds), client region, the caller's key id (never a secret), route,
prompt tokens, the prompt's 16-token block hashes (equal hashes are shared prefixes; the text
cannot be recovered from them), ``max_tokens``, the tokens actually generated, and the stream
flag. Requests that generated nothing or failed are not logged.

Invariants: ``record`` never raises into the request path (a full disk is counted in
``errors``); lines are appended and flushed in batches, and ``close`` flushes the rest.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from routing.blocks import BLOCK_SIZE
from routing.profile import RequestProfile
from routing.sim.trace import TraceRequest

log = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, path: str | os.PathLike[str], flush_every: int = 64) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._pending = 0
        self.flush_every = flush_every
        self.written = 0
        self.errors = 0

    def record(
        self,
        profile: RequestProfile,
        completion_tokens: int,
        arrival_s: float | None = None,
    ) -> None:
        """Append one request that generated ``completion_tokens`` (>= 1) tokens."""
        if completion_tokens < 1:
            return
        try:
            max_tokens = profile.max_tokens
            req = TraceRequest(
                arrival_s=arrival_s if arrival_s is not None else time.time(),
                prompt_tokens=max(1, profile.prompt_tokens),
                output_tokens=completion_tokens
                if max_tokens is None
                else min(completion_tokens, max_tokens),
                max_tokens=max_tokens,
                region=profile.client_region or "local",
                api_key=profile.api_key or "anonymous",
                route="chat" if profile.route == "chat" else "completions",
                stream=profile.stream,
                hash_ids=list(profile.block_hashes) or None,
                hash_block_tokens=BLOCK_SIZE,
            )
            line = json.dumps(req.model_dump(exclude_defaults=True), separators=(",", ":"))
            with self._lock:
                self._f.write(line + "\n")
                self.written += 1
                self._pending += 1
                if self._pending >= self.flush_every:
                    self._f.flush()
                    self._pending = 0
        except (OSError, ValueError) as exc:
            self.errors += 1
            if self.errors == 1:
                log.warning("request log %s: %s", self.path, exc)

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                self._f.close()
