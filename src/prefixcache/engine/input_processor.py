"""Input processing: every check a request gets before it queues, in one place.

`InputProcessor` turns a prompt (text or token ids) and its `SamplingParams` into the token ids
the engine runs, refusing what could never run with an `InvalidParam` that names the field:
an empty prompt, a token id outside the vocabulary, more choices than the engine runs at once,
a prompt plus ``max_tokens`` past the context or the KV pool, a ``logit_bias`` id outside the
vocabulary, or a request over its domain's caps. `LLMEngine.add_request` calls it; so
does the server (through `AsyncEngine.inputs`) before it queues, so a bad request is a 400 and
the rules live here alone. It holds no request state and is safe to call from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.errors import InvalidParam
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.sched.fairness import DomainLimits, blocks_needed

__all__ = ["InputProcessor"]


class InputProcessor:
    """The checks for one engine's model (``vocab_size``, ``max_model_len``), pool
    (``num_kv_blocks`` of ``block_size`` tokens) and scheduler (``max_num_seqs``,
    ``limits_for(domain)``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_kv_blocks: int,
        max_num_seqs: int,
        limits_for: Callable[[str], DomainLimits],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_num_seqs = max_num_seqs
        self._limits_for = limits_for

    def process(
        self,
        prompt: str | SequenceABC[int] | None,
        prompt_token_ids: SequenceABC[int] | None,
        params: SamplingParams,
        domain: str = "",
    ) -> list[int]:
        """The prompt's token ids, after every check (raises `InvalidParam`)."""
        token_ids = self.prompt_ids(prompt, prompt_token_ids)
        self.check_params(params)
        self.check_length(len(token_ids), params)
        self.check_domain_caps(len(token_ids), params, domain)
        return token_ids

    def prompt_ids(
        self,
        prompt: str | SequenceABC[int] | None,
        prompt_token_ids: SequenceABC[int] | None = None,
        where: str = "prompt",
    ) -> list[int]:
        """Exactly one of text (encoded here) and token ids; never empty. ``where`` names the
        prompt in messages (``prompt 2`` of a batch)."""
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidParam("prompt", "give exactly one of prompt and prompt_token_ids")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParam("prompt", f"the {where} is empty")
            return list(self.tokenizer.encode(prompt))
        ids = prompt if prompt_token_ids is None else prompt_token_ids
        token_ids = list(ids)  # type: ignore[arg-type]  # one of the two is set
        if not token_ids:
            raise InvalidParam("prompt", f"the {where} is empty (no token ids)")
        self.check_token_ids(token_ids, "prompt")
        return token_ids

    def check_token_ids(self, token_ids: SequenceABC[object], param: str) -> None:
        """Integers in the vocabulary ``[0, vocab_size)``."""
        vocab = self.vocab_size
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidParam(param, f"{param} token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < vocab:
                raise InvalidParam(
                    param, f"{param} token id {token_id} is outside the vocabulary [0, {vocab})"
                )

    def check_params(self, params: SamplingParams) -> None:
        """What the parameters ask of this engine: choices it can run at once, and token ids
        (``logit_bias``) in its vocabulary."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.n > self.max_num_seqs:
            raise InvalidParam(
                "n", f"n must be between 1 and {self.max_num_seqs}, got {params.n}"
            )
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise InvalidParam(
                "logit_bias",
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
            )

    def check_length(self, num_prompt: int, params: SamplingParams) -> None:
        """The prompt plus ``max_tokens`` fits the context, and one choice fits the whole pool
        (else it could never finish)."""
        total = num_prompt + params.max_tokens
        if total > self.max_model_len:
            raise InvalidParam(
                "prompt",
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length of {self.max_model_len} tokens",
            )
        needed = -(-total // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidParam(
                "prompt",
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) needs {needed} "
                f"KV blocks of {self.block_size} tokens, but the pool has only "
                f"{self.num_kv_blocks}",
            )

    def check_domain_caps(self, num_prompt: int, params: SamplingParams, domain: str) -> None:
        """A request that could never fit its domain's caps is refused now, not queued forever."""
        limits = self._limits_for(domain)
        num = params.num_choices
        name = "best_of" if params.ranks_choices else "n"
        if limits.max_seqs is not None and num > limits.max_seqs:
            raise InvalidParam(
                name,
                f"{name} ({num}) exceeds this caller's limit of {limits.max_seqs} running sequences"
            )
        needed = blocks_needed(num_prompt, params.max_tokens, num, self.block_size)
        if limits.max_blocks is not None and needed > limits.max_blocks:
            raise InvalidParam(
                name,
                f"{name} ({num}) x (prompt {num_prompt} + max_tokens {params.max_tokens} tokens) "
                f"needs up to {needed} KV blocks, over this caller's limit of {limits.max_blocks}"
            )
