"""The tokenizer endpoints: ``/tokenize`` and ``/detokenize`` (vLLM's), and
``/tokenizer_info`` (what a remote-tokenizer client such as lm-eval reads)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Request

from prefixcache.server.errors import ApiError
from prefixcache.server.openapi import operation_id
from prefixcache.server.protocol import DetokenizeRequest, JSONObject, TokenizeRequest
from prefixcache.server.serving_context import ServingContext, as_api_error, text_bytes
from prefixcache.server.tenancy import Tenant

__all__ = ["ServingTokenization", "tokenization_router"]


class ServingTokenization:
    """Tokenize, detokenize and describe the tokenizer of the served model."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.tokenizer = context.tokenizer

    async def tokenize(self, body: TokenizeRequest) -> JSONObject:
        context = self.context
        context.check_ignored(body)
        if body.model is not None:
            context.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            ids = await context.render_messages(body.messages, "messages",
                                                body.add_generation_prompt)
        else:
            assert body.prompt is not None
            context.check_prompt_bytes(text_bytes(body.prompt), "prompt")
            ids = await context.off_loop(
                lambda text: list(self.tokenizer.encode(text, body.add_special_tokens)),
                body.prompt)
        strs = [context.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": context.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> JSONObject:
        self.context.check_ignored(body)
        if body.model is not None:
            self.context.check_model(body.model)
        with as_api_error():
            self.context.inputs.check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def tokenizer_info(self) -> JSONObject:
        """What a remote-tokenizer client (lm-eval) needs: special tokens and the template."""
        special = self.tokenizer.special_tokens
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": special.get("eos_token"),
            "bos_token": special.get("bos_token"),
            "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"),
            "chat_template": self.tokenizer.chat_template,
            "model_max_length": self.context.max_model_len,
            "vocab_size": self.context.vocab_size,
        }


def tokenization_router(
    serving: ServingTokenization, auth: Callable[[Request], Tenant]
) -> APIRouter:
    router = APIRouter(generate_unique_id_function=operation_id)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, tenant: Tenant = Depends(auth)) -> JSONObject:
        return await serving.detokenize(body)

    @router.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info(tenant: Tenant = Depends(auth)) -> JSONObject:
        return serving.tokenizer_info()

    return router
