"""`OpenAIServing`: every OpenAI-style API of the server over one model.

Each API is its own module over `serving_base.ServingBase` (the checks, tokenizing off the loop,
queueing and finishing a request's prompts): `completions.py`, `chat.py`, `responses.py` and
`tokenizer_api.py`; each renders its responses through its own `Rendering`. This class is all of
them together, what `app.create_app` routes to.
"""

from __future__ import annotations

from prefixcache.server.cache_api import CacheAPI
from prefixcache.server.chat import ChatAPI
from prefixcache.server.completions import CompletionsAPI
from prefixcache.server.messages import MessagesAPI
from prefixcache.server.responses import ResponsesAPI
from prefixcache.server.tokenizer_api import TokenizerAPI

__all__ = ["OpenAIServing"]


class OpenAIServing(CacheAPI, CompletionsAPI, MessagesAPI, ChatAPI, ResponsesAPI, TokenizerAPI):
    """Completions, chat completions, responses, Anthropic's messages and the tokenizer
    endpoints over one model."""
