"""OpenAI request and response bodies (the subset this gateway serves), validated by pydantic:
the shared base (``base``), the fields both requests share (``sampling``), the chat
(``chat``) and completions (``completions``) requests, reply pieces (``replies``) and which
streams can resume (``resume``).

Invariant: the gateway validates every body with these models at its edge and each node again
with the same models, so a bad request is a 400 naming its field at either, never a 500.
"""

from gateway.openai_schema.base import Text, unsupported
from gateway.openai_schema.chat import ChatCompletionRequest
from gateway.openai_schema.completions import CompletionRequest
from gateway.openai_schema.replies import Usage, model_card, usage
from gateway.openai_schema.resume import resumable

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "Text",
    "Usage",
    "model_card",
    "resumable",
    "unsupported",
    "usage",
]
