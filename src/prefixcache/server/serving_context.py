"""`ServingContext`: what every API's serving object shares over one model — the engine thread,
the tokenizer and its limits, tenancy, metrics, the server's options — and the checks and
tokenizing every API does alike (off the event loop: a long prompt must not stall the other
connections).

Each API is its own serving object holding this context (`chat.OpenAIServingChat`,
`completions.OpenAIServingCompletion`, ...); the context knows no API's request body beyond the
fields all of them have. Prompt text and token ids never reach a log line; neither do the values
of ignored fields, only their (sanitised) names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from prefixcache.cache import Sequence as CacheSequence
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.errors import InvalidParam
from prefixcache.server.async_engine import AsyncEngine
from prefixcache.server.diagnostics import Diagnoser, Diagnosis, Fingerprint
from prefixcache.server.diagnostics_store import FingerprintStore
from prefixcache.server.errors import ApiError
from prefixcache.server.jobs import Prompts
from prefixcache.server.logprobs import TokenText
from prefixcache.server.lora import ServingLoras
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.protocol import ChatMessage, JSONObject, Lenient
from prefixcache.server.request_params import render_chat
from prefixcache.server.tenancy import Tenant, TenantRegistry

__all__ = ["ServingContext", "ServingOptions", "as_api_error", "param_of", "text_bytes"]

logger = logging.getLogger("prefixcache.server")

_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
A = TypeVar("A")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """The server's choices every API applies alike."""

    model_name: str
    default_max_tokens: int = 256  # chat and responses, when the client sends no limit
    trust_content_markers: bool = False  # False: markers in message content are text
    strict_api: bool = False  # unknown request fields: 400 instead of a log line


class ServingContext:
    """The engine, tokenizer, limits, tenancy and metrics of one model, and the shared checks."""

    def __init__(
        self, engine: AsyncEngine, tenants: TenantRegistry, metrics: ServerMetrics,
        options: ServingOptions, diagnostics_store: FingerprintStore | None = None,
    ) -> None:
        self.engine = engine
        self.inputs = engine.inputs
        self.tokenizer = engine.tokenizer
        limits = engine.limits
        self.max_model_len = limits.max_model_len
        self.block_size = limits.block_size
        self.vocab_size = limits.vocab_size
        self.precision = dict(limits.precision)  # what the model runs in, for /v1/models
        self.tenants = tenants
        self.metrics = metrics
        self.options = options
        self.model_name = options.model_name
        self.token_text = TokenText(self.tokenizer)
        # why a request missed: per tenant, kept beside the lower tier where there is one
        self.diagnoser = Diagnoser(self.block_size, store=diagnostics_store)
        identity = engine.cache_identity  # weights, dtype and KV layout: what a block means
        self.model_identity = f"{identity.model_id}|{identity.kv_layout or ''}"
        self.loras = ServingLoras(engine, options.model_name)  # the LoRA adapters by model name
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    def diagnosis(
        self, tenant: Tenant, cache_salt: str | None, token_ids: list[int],
        segments: Sequence[tuple[str, object]], messages: Sequence[object], earlier_id: str | None,
    ) -> Diagnosis:  # fmt: skip
        """``tenant``'s request as diagnostics compare it: its ``segments`` (in the order a
        change is reported, the first the model it names: the base model's name, then its
        weights and dtype, then the LoRA adapter it runs under, by content), ``messages``, and
        its prompt's blocks as its cache names them (the adapter's namespace)."""
        (_, model), *rest = segments
        adapter = self.adapter_of(str(model))
        base = self.model_name if adapter is not None else model
        segments = [("model", base), ("dtype_or_weights", self.model_identity),
                    ("adapter", adapter), *rest]
        scope = self.tenants.scope(tenant, cache_salt)
        num_public = (self.tenants.public.num_public_blocks(tenant, token_ids, self.block_size)
                      if scope.use_cache else 0)
        seq = CacheSequence("diagnosis", token_ids, scope.salt, adapter=adapter,
                            use_cache=scope.use_cache, public_blocks=num_public)
        blocks = self.engine.cache_identity.block_digests(seq) if scope.use_cache else []
        fingerprint = Fingerprint.of(segments, messages, blocks, len(token_ids))
        metrics, isolation = self.metrics, tenant.isolation_domain
        domain, engine = tenant.scheduling_domain, self.engine
        return Diagnosis(self.diagnoser, tenant.tenant_id, fingerprint, earlier_id,
                         lambda reason: metrics.count_miss_reason(isolation, reason),
                         lambda digest, since: engine.block_fate(digest, domain, since),
                         use_cache=scope.use_cache, public_tokens=num_public * self.block_size)

    async def off_loop(self, fn: Callable[[A], T], arg: A) -> T:
        """Run ``fn(arg)`` (tokenizing, a chat template, a grammar) on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, arg)

    # ---- checks ---------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        """The base model's name or a loaded LoRA adapter's (else a 404, as OpenAI's and
        vLLM's)."""
        if model != self.model_name and self.loras.identity_of(model) is None:
            adapters = " or a loaded LoRA adapter" if self.loras.registry is not None else ""
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}{adapters}", param="model",
                           code="model_not_found")

    def adapter_of(self, model: str) -> str | None:
        """The identity of the LoRA adapter a request for ``model`` runs under (its content
        digest, ``lora:<sha256>``: what its blocks' namespace carries), None for the base."""
        return self.loras.identity_of(model)

    def check_ignored(self, body: Lenient) -> None:
        """Unknown top-level fields: 400 under --strict-api, else one log line naming them."""
        names = body.ignored_fields()
        if not names:
            return
        if self.options.strict_api:
            raise ApiError(400, f"unknown parameter {_safe_name(names[0])!r}",
                           param=_safe_name(names[0]))
        shown = ", ".join(_safe_name(n) for n in names[:16])
        more = f" (+{len(names) - 16} more)" if len(names) > 16 else ""
        logger.warning("ignoring unknown request field(s): %s%s", shown, more)

    def check_prompt_bytes(self, num_bytes: int, param: str) -> None:
        """Refuse, before tokenizing, a text that must hold more tokens than the context."""
        limit = self.max_model_len * self.tokenizer.max_token_bytes
        if num_bytes > limit:
            raise ApiError(400, f"the prompt is {num_bytes} bytes: more tokens than this "
                           f"model's context of {self.max_model_len} can hold", param=param)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """The output limit of a chat or response whose client sent none: what the context
        leaves, at most the server's default."""
        room = self.max_model_len - num_prompt_tokens
        return max(1, min(self.options.default_max_tokens, room))

    # ---- tokenizing -----------------------------------------------------------------------

    async def render_messages(
        self, messages: list[ChatMessage], param: str, add_generation_prompt: bool,
        tools: list[JSONObject] | None = None, *, allow_empty: bool = False,
    ) -> list[int]:
        """A conversation's token ids through the model's chat template, off the loop."""
        literal = not self.options.trust_content_markers
        return await self.off_loop(
            lambda m: render_chat(self.tokenizer, m, param, add_generation_prompt, tools,
                                  literal_content=literal, allow_empty=allow_empty),
            messages)

    async def encode_prompts(self, prompts: list[str | list[int]]) -> Prompts:
        """Each prompt (text or token ids) as checked token ids, with its text; off the loop."""
        return await self.off_loop(self._encode_prompts, prompts)

    def _encode_prompts(self, prompts: list[str | list[int]]) -> Prompts:
        out: Prompts = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt {i}"
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            with as_api_error():
                out.append((self.inputs.prompt_ids(text, ids, where), text))
        return out

    # ---- sampling -------------------------------------------------------------------------

    def sampling_params(
        self, make: Callable[[], SamplingParams], param_names: dict[str, str] | None = None
    ) -> SamplingParams:
        """``make()``'s parameters, checked against the model; a bad value is a 400 naming its
        field (``param_names``: the API's name for an engine field, where they differ)."""
        try:
            params = make()
        except ValueError as exc:
            param = param_of(exc)
            raise ApiError(400, str(exc),
                           param=(param_names or {}).get(param or "", param)) from None
        with as_api_error():
            self.inputs.check_params(params)
        return params

    async def compile(self, params: SamplingParams, param: str) -> None:
        """Compile (and cache) the request's output grammar off the event loop, so a bad one is
        a 400 naming ``param``, the field it came from, and the engine thread finds it compiled."""
        spec = params.structured_outputs
        if spec is None:
            return
        grammars = self.engine.grammars
        try:
            await self.off_loop(lambda s: grammars.grammar(s, param), spec)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=param_of(exc) or param) from None


def text_bytes(prompt: object) -> int:
    """UTF-8 bytes of the text in a prompt (a string, or a list of strings); 0 for token ids."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    if isinstance(prompt, list):
        return sum(len(p.encode("utf-8")) for p in prompt if isinstance(p, str))
    return 0


@contextlib.contextmanager
def as_api_error() -> Iterator[None]:
    """An engine input check's `InvalidParam` as a 400 naming the field."""
    try:
        yield
    except InvalidParam as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def param_of(exc: ValueError) -> str | None:
    """The request field an engine/params error names (`InvalidParam`), for the error body."""
    return exc.param if isinstance(exc, InvalidParam) else None


def _safe_name(name: str) -> str:
    """A field name fit for a log line: short, plain characters; anything else is elided."""
    return name if _FIELD_NAME.fullmatch(name) else "<unprintable>"
