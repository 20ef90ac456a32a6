"""Admission: whether a request can ever run on this engine, and a new sequence's own state.

:func:`check_request` refuses, before anything is queued, an empty prompt, a prompt plus
``max_tokens`` beyond the context or the whole KV pool (:class:`routing.engine.RequestTooLong`)
and token ids outside the model's vocabulary (:class:`InvalidRequest`). :func:`prepare_sequence`
gives a sequence its sampling generator (``cloud_engine.sampler.prepare``: parameters checked),
its grammar state and its prompt's block hashes; it touches nothing but the sequence, so a
request that fails there fails alone. Neither looks at the queue.
"""

from __future__ import annotations

import torch

from cloud_engine.sampler import prepare
from cloud_engine.sequence import Sequence
from routing.engine import EngineError, GenerationRequest, RequestTooLong


class InvalidRequest(EngineError):
    """The request can never run (token ids outside the model's vocabulary): HTTP 400."""


def check_request(
    request: GenerationRequest, vocab_size: int, max_context: int, num_blocks: int, block_size: int
) -> None:
    """Raise where ``request`` can never run here: a model of ``vocab_size`` tokens and
    ``max_context`` positions over a pool of ``num_blocks`` blocks of ``block_size`` tokens."""
    n = len(request.prompt_token_ids)
    if n == 0:
        raise RequestTooLong("empty prompt")
    ids = request.prompt_token_ids
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"token ids must lie in [0, {vocab_size})")
    total = n + request.sampling.max_tokens
    if total > max_context:
        raise RequestTooLong(
            f"prompt ({n}) + max_tokens ({request.sampling.max_tokens}) = {total} tokens "
            f"exceeds the context of {max_context}"
        )
    need = -(-total // block_size)
    if need > num_blocks:
        raise RequestTooLong(f"{total} tokens need {need} KV blocks; the pool has {num_blocks}")


def prepare_sequence(seq: Sequence, device: torch.device, seed: int, block_size: int) -> None:
    """Give ``seq`` its generator (on ``device``), grammar state and block hashes (``seed``:
    the model's); raises where its request cannot be prepared."""
    request = seq.request
    seq.generator = prepare(request.sampling, device)
    if request.sampling.grammar is not None:
        seq.grammar = request.sampling.grammar.start()
    seq.extend_hashes(seed, block_size)
