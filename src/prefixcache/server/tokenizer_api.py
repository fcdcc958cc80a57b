"""The tokenizer endpoints: ``/tokenize`` and ``/detokenize`` (vLLM's), and
``/tokenizer_info`` (what a remote-tokenizer client such as lm-eval reads)."""

from __future__ import annotations

from prefixcache.server.errors import ApiError
from prefixcache.server.protocol import DetokenizeRequest, JSONObject, TokenizeRequest
from prefixcache.server.serving_base import ServingBase, as_api_error, text_bytes

__all__ = ["TokenizerAPI"]


class TokenizerAPI(ServingBase):
    """Tokenize, detokenize and describe the tokenizer of the served model."""

    async def tokenize(self, body: TokenizeRequest) -> JSONObject:
        self._check_ignored(body)
        if body.model is not None:
            self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            ids = await self._off_loop(
                self._render_messages,
                (body.messages, "messages", body.add_generation_prompt, None))
        else:
            assert body.prompt is not None
            self._check_prompt_bytes(text_bytes(body.prompt), "prompt")
            ids = await self._off_loop(
                lambda text: list(self.tokenizer.encode(text, body.add_special_tokens)),
                body.prompt)
        strs = [self.token_text(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> JSONObject:
        self._check_ignored(body)
        if body.model is not None:
            self._check_model(body.model)
        with as_api_error():
            self.inputs.check_token_ids(body.tokens, "tokens")
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
            "model_max_length": self.max_model_len,
            "vocab_size": self.vocab_size,
        }
