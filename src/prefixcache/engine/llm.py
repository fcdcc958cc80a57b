"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))` runs a batch to completion.

    from prefixcache import LLM, SamplingParams
    llm = LLM(model="tiny")
    outs = llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=16, temperature=0.0))
    outs[0].text, outs[0].token_ids, outs[0].num_cached_tokens, outs[0].finish_reason
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))   # as vLLM's
    llm = LLM(model="tiny", enable_lora=True, max_loras=4)
    llm.generate("Hi", params, lora_request=LoRARequest("sql", 1, "/path/to/adapter"))

A thin loop over `LLMEngine`; everything that matters happens there.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from prefixcache.engine.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.lora import LoraRegistry, LoRARequest, lora_requests
from prefixcache.engine.outputs import CompletionOutput, GenerationOutput, best_of
from prefixcache.engine.request import Request
from prefixcache.engine.sampling_params import SamplingParams

__all__ = ["LLM"]

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM:
    """Offline generation over one `LLMEngine`. Keyword arguments are `EngineConfig.from_kwargs`'s
    (``max_num_seqs``, ``max_num_batched_tokens``, ``schedule_policy``, ``check_integrity``,
    ...), or pass a whole ``config``."""

    def __init__(
        self,
        model: Any = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool | None = None,
        prefix_cache: str | None = None,
        hash_algo: str | None = None,
        seed: int | None = None,
        *,
        config: EngineConfig | None = None,
        **settings: Any,
    ) -> None:
        named = {
            "block_size": block_size,
            "num_kv_blocks": num_kv_blocks,
            "enable_prefix_caching": enable_prefix_caching,
            "prefix_cache": prefix_cache,
            "hash_algo": hash_algo,
            "seed": seed,
        }
        settings.update({k: v for k, v in named.items() if v is not None})
        self.engine = LLMEngine(model, config=config, **settings)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | bytes | None = None,
        use_cache: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (a string, a token-id list, or a list of either); outputs
        come back in prompt order. A bad prompt raises ValueError before anything runs.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), as vLLM's."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        loras = lora_requests(lora_request, len(batch))
        requests = self._add_all(batch, params, cache_salt, use_cache, loras)
        while any(not r.all_finished for r in requests):
            self.engine.step()
        return [_result(r, p) for r, p in zip(requests, batch, strict=True)]

    def _add_all(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        cache_salt: str | bytes | None,
        use_cache: bool,
        loras: list[LoRARequest | None],
    ) -> list[Request]:
        requests: list[Request] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                request_id = f"generate-{next(self._ids)}"
                requests.append(self.engine.add_request(
                    request_id, prompt, p, cache_salt=cache_salt, use_cache=use_cache,
                    lora_request=lora))  # fmt: skip
        except ValueError as exc:
            for request in requests:
                self.engine.abort(request.request_id)
            raise ValueError(f"prompt {len(requests)}: {exc}") from None
        return requests

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | bytes | None = None,
        use_cache: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        to a list of conversations, rendered with the model's chat template (or
        ``chat_template``), as vLLM's ``LLM.chat``. Outputs as `generate`'s; ``prompt`` holds
        the rendered text. Marker strings typed inside message content stay text (see
        `Tokenizer.encode_chat`)."""
        conversations = _as_conversations(messages)
        texts = [self.chat_prompt_text(c, chat_template, add_generation_prompt)
                 for c in conversations]
        prompts: list[Prompt] = [
            self.tokenizer.encode_rendered_chat(text, [dict(m) for m in c])
            for text, c in zip(texts, conversations, strict=True)
        ]
        outputs = self.generate(prompts, sampling_params, cache_salt, use_cache, lora_request)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def chat_prompt_text(
        self,
        messages: Sequence[Message],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """One conversation rendered with the chat template, as the model will read it."""
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt, chat_template=chat_template
        )
        return str(text)

    def chat_prompt(
        self,
        messages: Sequence[Message],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The token ids `chat` runs for one conversation: marker strings inside a message's
        content are encoded as text, only the template's own markers as control tokens."""
        return list(self.tokenizer.encode_chat(
            [dict(m) for m in messages], add_generation_prompt, chat_template=chat_template
        ))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and load a LoRA adapter (raises `LoraError` for a bad one), as vLLM's."""
        self._loras().add(lora_request)
        return True

    def remove_lora(self, lora_id: int | str) -> bool:
        """Unregister an adapter by its int id or name; its cached blocks go once no request
        runs under it. False: no such adapter."""
        loras = self._loras()
        names = [r.lora_name for r in loras.requests() if lora_id in (r.lora_int_id, r.lora_name)]
        return any([loras.remove(name) for name in names])

    def list_loras(self) -> set[int]:
        """The int ids of the registered adapters, as vLLM's."""
        return {r.lora_int_id for r in self._loras().requests()}

    def _loras(self) -> LoraRegistry:
        if self.engine.loras is None:
            raise ValueError("LoRA is off: LLM(..., enable_lora=True)")
        return self.engine.loras

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (refused, False, while requests hold blocks)."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        """Hit tokens, queries, evictions, preemptions, TTFT per request, and cache counters."""
        return self.engine.stats()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[object] = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [cast("list[int]", items)]  # one prompt given as token ids
    for item in items:
        if not isinstance(item, (str, list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {item!r}")
    return cast("list[Prompt]", items)


def _as_conversations(
    messages: Sequence[Message] | Sequence[Sequence[Message]],
) -> list[Sequence[Message]]:
    items = list(messages)
    if not items:
        raise ValueError("no messages given")
    if all(isinstance(m, Mapping) for m in items):
        return [items]  # type: ignore[list-item]  # one conversation
    for item in items:
        if isinstance(item, (str, bytes, Mapping)) or not all(
            isinstance(m, Mapping) for m in item
        ):
            raise ValueError("messages must be a list of {'role', 'content'} dicts, or a list "
                             "of such lists (several conversations)")
    return items  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    items = list(params)
    if len(items) != num_prompts:
        raise ValueError(f"{len(items)} sampling params for {num_prompts} prompts")
    return items


def _result(request: Request, prompt: Prompt) -> GenerationOutput:
    choices = request.choices
    if request.params.ranks_choices:  # best_of: the n best by cumulative logprob, re-indexed
        ranked = best_of([r.cumulative_logprob for r in choices], request.params.n)
        choices = [choices[i] for i in ranked]
    tracks = request.params.logprobs is not None or request.params.ranks_choices
    outputs = [
        CompletionOutput(
            index=index,
            token_ids=list(r.output_token_ids),
            text=r.text,
            finish_reason=r.finish_reason,
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
            cumulative_logprob=r.cumulative_logprob if tracks else None,
            stop_reason=r.stop_reason,
        )
        for index, r in enumerate(choices)
    ]
    return GenerationOutput(
        request_id=request.request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        ttft=request.timing.ttft,
        prompt_logprobs=request.prompt_logprobs,
    )
