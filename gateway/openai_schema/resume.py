"""Whether a request's broken stream can be resumed on another node (``gateway.front.resume``).

Invariant: only a stream of one choice without logprobs or echo is resumable, since a resume
continues from the token ids of that one choice's text.
"""

from __future__ import annotations

from gateway.openai_schema.chat import ChatCompletionRequest
from gateway.openai_schema.completions import CompletionRequest


def resumable(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether a broken stream of ``req`` can be resumed from its token ids on another node
    (``gateway.front.resume``): one choice, no logprobs, no echo."""
    if req.n != 1 or req.logprobs:
        return False
    return not (isinstance(req, CompletionRequest) and (req.echo or req.logprobs is not None))
