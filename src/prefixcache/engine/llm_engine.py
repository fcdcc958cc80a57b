"""`LLMEngine`: requests in, incremental outputs out, one bounded `step()` at a time.

The engine is the core loop over its parts, as vLLM v1 splits its engine: input processing
(`InputProcessor`: every request check), then per step schedule (the scheduler over the prefix
cache's block ids) -> execute (the runner's tensors) -> sample (`StepSampler`) -> update (the
scheduler's commit, then `OutputProcessor`: stop rules, detokenized text, `RequestOutput`).
It is single-threaded: a server drives it from one thread and calls `add_request` / `abort`
between steps.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from typing import Any, cast

from prefixcache.attention.kv_cache import KVLayout, PagedKVCache
from prefixcache.cache import CacheIdentity, PrefixCache, evict_domain, make_prefix_cache
from prefixcache.cache.base import CacheObserver
from prefixcache.cache.events import KVCacheEvent
from prefixcache.cache.fates import BlockFates, Fate
from prefixcache.cache.pins import PinTable
from prefixcache.engine import observation
from prefixcache.engine.config import DEFAULT_KV_MEMORY_BYTES, EngineConfig
from prefixcache.engine.groups import RequestGroups
from prefixcache.engine.input_processor import InputProcessor
from prefixcache.engine.lora import LoraBusy, LoraNotFound, LoraRegistry, LoRARequest
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.outputs import EngineLimits, EngineSnapshot, EngineView, RequestOutput
from prefixcache.engine.request import Request
from prefixcache.engine.runner import ModelRunner
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.step_sampling import StepSampler, record_prompt_logprobs
from prefixcache.engine.structured import GrammarCompiler
from prefixcache.engine.tiering import TierTraffic
from prefixcache.errors import InvalidParam
from prefixcache.model.config import ModelConfig
from prefixcache.model.loader import LoadedModel
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.sched import Scheduler, SchedulerOutput

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "LLMEngine"]

logger = logging.getLogger(__name__)



class LLMEngine:
    """Continuous-batching generation over a paged, prefix-cached KV pool.

    Configured by one `EngineConfig` (``engine_config``): ``model`` is a built-in name
    (``"smollm2"``, ``"tiny"``, ``"small"``), a checkpoint directory, a .gguf file or a
    `LoadedModel`. ``kv_events``: buffer the cache's KV events (bounded) for a consumer that
    drains them with `take_kv_events`; off, nothing is kept. ``num_kv_blocks=None`` sizes the
    pool from ``kv_cache_memory_bytes``. ``check_integrity`` verifies every cache invariant
    after each step (tests). The engine leaves the process's malloc alone: ``prefixcache
    serve`` opts in to keeping freed tensor memory (`prefixcache.model.host_memory`).
    """

    def __init__(
        self, model: Any = None, *, config: EngineConfig | None = None, **settings: Any
    ) -> None:
        """``config``, or ``model`` and the flat keywords of `EngineConfig.from_kwargs`."""
        self.engine_config = config = _config(model, config, settings)
        self.loaded: LoadedModel = _load(config)
        self.model_config: ModelConfig = self.loaded.config
        self.tokenizer: Tokenizer = self.loaded.tokenizer
        self.max_model_len: int = self.model_config.max_model_len
        self.block_size = config.block_size
        self.kv_layout = self.loaded.kv_layout_for(config.kv_cache_dtype)
        # which kernels run the model: fixed once it is loaded and packed (`CausalLM.kernels`)
        self.kernels: dict[str, Any] = self.loaded.kernels(self.kv_layout)
        num_blocks = config.cache.num_blocks or _default_num_blocks(
            self.kv_layout, self.block_size, self.max_model_len, config
        )
        self.cache: PrefixCache = make_prefix_cache(
            replace(config.cache, num_blocks=num_blocks, model_id=self.loaded.identity,
                    kv_layout=self.kv_layout.namespace_layout)
        )
        self.runner = ModelRunner(self.loaded.model, self.kv_layout.allocate(
            num_blocks, self.block_size, self.loaded.device))
        self.scheduler: Scheduler[Request] = Scheduler(self.cache, config.scheduler)
        # LoRA adapters (None: off); their rows' updates run beside the base projections
        self.loras = self.runner.loras = (
            LoraRegistry(self.model_config, config.lora, self._evict_namespaces,
                         self.loaded.dtype)
            if config.lora.enable_lora else None)  # fmt: skip
        self.fates = self.cache.allocator.fates = BlockFates()  # why blocks left: diagnostics
        # the lower tiers (disk, Valkey): written behind each step, read ahead of admission
        self.tiers = _open_tiers(self, config)
        # prefixes kept from eviction for a time (cache_control), per domain within a budget
        max_pinned = config.max_pinned_blocks
        self.pins = PinTable(self.cache, num_blocks // 4 if max_pinned is None else max_pinned,
                             budgets=config.pin_budgets)
        self.num_pins_released_by_reset = 0
        self.inputs = InputProcessor(
            self.tokenizer, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, block_size=self.block_size,
            num_kv_blocks=num_blocks, max_num_seqs=self.scheduler.max_num_seqs,
            limits_for=self.scheduler.limits_for,
        )  # fmt: skip
        self.sampler = Sampler(config.logprobs_mode)
        self.step_sampler = StepSampler(self.sampler, self.tokenizer.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.check_integrity = config.check_integrity
        self._seed_rng = random.Random(config.seed)
        self.groups = RequestGroups(self.scheduler, self.step_sampler, self.output_processor,
                                    self._retired)
        self._num_added = 0
        self.num_steps = 0
        self.last_scheduled: SchedulerOutput | None = None  # the latest step's batch
        # called on the engine's thread with the first choice of each finished request
        self.on_request_finished: Callable[[Request], None] | None = None
        self.limits: EngineLimits = observation.limits_of(self)  # fixed once it is loaded

    def tier_stats(self) -> dict[str, Any] | None:
        """The lower tiers' counters (None without tiers); safe from any thread."""
        return self.tiers.offload.stats_dict() if self.tiers is not None else None

    def block_fate(self, digest: bytes, domain: str, since: float) -> Fate | None:
        """Why ``domain``'s block ``digest`` (whole or truncated) left the cache after
        ``since`` (`time.monotonic`), if it is known; safe from any thread."""
        return self.fates.of(digest, domain, since)

    def add_cache_observer(self, observer: CacheObserver) -> None:
        """Tell ``observer`` about the cache's admissions, commits and frees (before the
        engine's thread starts)."""
        self.cache.add_observer(observer)

    def pins_of(self, domain: str) -> list[dict[str, Any]]:
        """``domain``'s pins as plain data (digests and counts, never tokens or text)."""
        return self.pins.describe(domain)

    def release_pin(self, pin_id: str, domain: str) -> bool:
        """Release ``domain``'s pin ``pin_id`` (False: no such pin of that domain)."""
        pin = self.pins.pins.get(pin_id)
        return pin is not None and pin.domain == domain and self.pins.release(pin_id)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one KV block holds for this engine's model."""
        return self.kv_layout.bytes_per_block(self.block_size)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceABC[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: SequenceABC[int] | None = None,
        cache_salt: str | bytes | None = None,
        use_cache: bool = True,
        arrival_time: float | None = None,
        domain: str = "",
        pins: SequenceABC[tuple[int, float]] = (),
        lora_request: LoRARequest | str | None = None,
        public_blocks: int = 0,
    ) -> Request:
        """Queue a request. Bad input raises ValueError (`InvalidParam` naming the field,
        from `InputProcessor`) and leaves the engine unchanged. ``domain`` is its isolation
        domain (tenant or group) for fair sharing and caps. ``pins``: ``(num_tokens, ttl_s)``
        prefixes of the prompt to keep from eviction once the request is done (cache
        breakpoints; `PinTable`). ``lora_request``: the LoRA adapter it runs under, or the name
        of one registered now (`LoraNotFound` if none is: the server's requests).
        ``public_blocks``: its leading blocks that are a declared public prefix's
        (`prefixcache.cache.public`), cached in the public namespace."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already running")
        token_ids = self.inputs.process(prompt, prompt_token_ids, params, domain)
        matcher = (None if params.structured_outputs is None  # compiled (or refused) now
                   else self.grammars.matcher(params.structured_outputs))  # fmt: skip
        _check_pins(pins)
        _check_public_blocks(public_blocks, len(token_ids) // self.cache.block_size)
        adapter, lora = _acquire(self.loras, lora_request)  # the last check: holds the adapter
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        self._num_added += 1
        request = Request.new(request_id, token_ids, params, base_seed, self._num_added,
                              cache_salt=cache_salt, use_cache=use_cache, domain=domain,
                              external=self.tiers is not None, adapter=adapter, lora=lora,
                              public_blocks=public_blocks)  # fmt: skip
        request.matcher = matcher
        if self.loras is not None and adapter is not None:
            self.loras.note_roots(adapter, self.cache.identity.roots(request.seq))
        if arrival_time is not None:
            request.timing.arrival_time = arrival_time
        request.pin_requests = [(min(n, request.num_prompt_tokens - 1), t) for n, t in pins]
        self.pins.refresh(request.seq)  # a request through a pinned prefix extends the pin
        self.groups.add(request)
        if self.tiers is None or not self.tiers.start_load(request):
            self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes with the next step.
        Returns False for an unknown (or already finished) request."""
        if not self.groups.abort(request_id):
            return False
        if self.tiers is not None:
            self.tiers.loading.pop(request_id, None)
        if self.check_integrity:
            self.cache.check_integrity()
        return True

    def has_unfinished(self) -> bool:
        loading = self.tiers is not None and bool(self.tiers.loading)
        return self.scheduler.has_unfinished() or bool(self.groups.pending) or loading

    def running_requests(self) -> list[Request]:
        """The choices running now (a copy; for inspection between steps)."""
        return list(self.scheduler.running)

    @property
    def kv_cache(self) -> PagedKVCache:
        """The paged KV tensors, for debugging tools."""
        return self.runner.kv_cache

    def inspect(self) -> EngineView:
        """What runs, waits and was last scheduled, and the pool's levels (between steps)."""
        return observation.view_of(self)

    def get_request(self, request_id: str) -> list[Request]:
        """The live choices of a request (empty once it finished)."""
        return self.groups.choices(request_id)

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; returns what each touched choice gained."""
        self.pins.expire()
        if self.tiers is not None:
            idle = not self.scheduler.has_unfinished() and not self.groups.pending
            self.tiers.admit_loaded(idle)
        outputs = self.groups.take_pending()
        out = self.scheduler.schedule()
        if out.is_empty and out.admission_blocked and not self.scheduler.running:
            out = self._unblock()
        self.last_scheduled = out
        self.num_steps += 1
        if not out.is_empty:
            _mark_scheduled(out)
            logits = self.runner.execute_step(out)
            targets = self.scheduler.update_from_step(out)
            if self.tiers is not None:
                self.tiers.write_behind(out)
            if logits.every_token:
                record_prompt_logprobs(out, logits)
            outputs.extend(self.groups.update(logits.last, targets))
        if self.check_integrity:
            self.cache.check_integrity()
        return outputs

    def _unblock(self) -> SchedulerOutput:
        """Nothing runs and the next waiting request cannot start, so nothing would ever free
        a block for it: lift the fair-share protection of the other domains' cached blocks for
        this step (nobody contends now), then release pins — another domain's oldest first —
        until it starts or no pin is left. A request that fits the cache always runs."""
        with self.scheduler.protection.lifted():
            out = self.scheduler.schedule()
            while (out.is_empty and out.admission_blocked
                   and self.pins.yield_to(self.scheduler.waiting[0].domain)):
                out = self.scheduler.schedule()
        return out

    def _retired(self, parent: Request) -> None:
        """``parent``'s request is done: pin what it asked to keep (if it ended well; a pin of
        an hour or more is written through to the lower tiers), then tell the listener."""
        if parent.pin_requests and parent.finish_reason in ("stop", "length"):
            for num_tokens, ttl_s in parent.pin_requests:
                pin = self.pins.pin(parent.seq, num_tokens, ttl_s)
                if pin is not None and self.tiers is not None:
                    self.tiers.pinned(pin.seq, ttl_s)
        if self.loras is not None and parent.seq.adapter is not None:
            self.loras.release(parent.seq.adapter)
        if self.on_request_finished is not None:
            self.on_request_finished(parent)

    # ---- cache control and stats ----------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """Counters and levels now (call between steps, on the engine's thread)."""
        return observation.snapshot_of(self)

    @property
    def cache_identity(self) -> CacheIdentity:
        """What names this engine's cache blocks."""
        return self.cache.identity

    def prompt_block_digests(self, request: Request) -> list[bytes]:
        """The digests of ``request``'s complete prompt blocks (what a trace records)."""
        num_blocks = request.num_prompt_tokens // self.block_size
        return self.cache.identity.block_digests(request.seq)[:num_blocks]

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Drain the KV events buffered since the last call (empty unless ``kv_events``): the
        cache's, then the shared tier's (`BlockStored` with ``medium="VALKEY"``)."""
        events = self.cache.take_events()
        if self.tiers is not None:
            events += self.tiers.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, pinned ones included (``num_pins_released_by_reset`` says
        how many pins went); refused (False, nothing changed) while requests hold blocks."""
        released = None if self.has_unfinished() else self.pins.reset_cache()
        self.num_pins_released_by_reset = released or 0
        return released is not None

    def stats(self) -> dict[str, Any]:
        """Cache counters, scheduler counters and per-request timing of finished requests."""
        return observation.stats_of(self)

    def purge_domain(self, domain: str) -> dict[str, int]:
        """Remove ``domain``'s blocks from every lower tier (records removed per tier); thread
        safe, it does not touch the RAM cache (`drop_domain`)."""
        return self.tiers.purge_domain(domain) if self.tiers is not None else {}

    def drop_domain(self, domain: str) -> int:
        """Evict ``domain``'s free cached blocks from the RAM cache and zero their KV (between
        steps, on the engine's thread); returns how many."""
        block_ids = evict_domain(self.cache, domain)
        self.runner.kv_cache.zero_blocks(block_ids)
        if self.check_integrity:
            self.cache.check_integrity()
        return len(block_ids)

    def _evict_namespaces(self, roots: set[bytes]) -> None:
        """Evict the cached blocks under these namespace roots (an unloaded adapter's), its
        pins released first."""
        root = self.cache.identity.root
        for pin in [p for p in self.pins.pins.values() if root(p.seq) in roots]:
            self.pins.release(pin.pin_id)
        self.cache.evict_namespaces(roots)
        if self.check_integrity:
            self.cache.check_integrity()

    def flush_tiers(self, timeout: float = 30.0) -> bool:
        """Wait until the blocks queued for the lower tiers are written (False on timeout)."""
        return self.tiers.offload.flush(timeout) if self.tiers is not None else True

    def close(self) -> None:
        """Finish the tiers' queued writes and stop their threads (idempotent)."""
        if self.tiers is not None:
            self.tiers.offload.close()


def _config(model: Any, config: EngineConfig | None, settings: dict[str, Any]) -> EngineConfig:
    if config is None:
        return EngineConfig.from_kwargs("tiny" if model is None else model, **settings)
    if settings:
        raise TypeError("give an EngineConfig or keyword settings, not both")
    return config if model is None else replace(config, model=model)


def _open_tiers(engine: LLMEngine, config: EngineConfig) -> TierTraffic | None:
    tiers = TierTraffic.open(config.tiers, engine.loaded.identity, engine.cache,
                             engine.runner.kv_cache, engine.scheduler)
    if tiers is not None:  # its threads must not outlive the engine; not at exit, where
        # waking them would run tensor work while torch is being torn down
        weakref.finalize(engine, tiers.offload.stop).atexit = False
    return tiers


def _default_num_blocks(
    layout: KVLayout, block_size: int, max_model_len: int, config: EngineConfig
) -> int:
    """What fits in ``kv_cache_memory_bytes``, capped at what ``max_num_seqs`` full-length
    sequences could use."""
    fit = layout.blocks_in(config.kv_cache_memory_bytes, block_size)
    return min(fit, config.scheduler.max_num_seqs * -(-max_model_len // block_size))


def _mark_scheduled(out: SchedulerOutput) -> None:
    now = time.monotonic()
    for chunk in out.chunks:
        timing = cast(Request, chunk.request).timing  # the scheduler holds our requests
        if timing.first_scheduled_time is None:
            timing.first_scheduled_time = now


def _check_pins(pins: SequenceABC[tuple[int, float]]) -> None:
    for num_tokens, ttl_s in pins:
        if num_tokens < 0 or not ttl_s > 0:
            raise ValueError(f"a pin needs num_tokens >= 0 and ttl_s > 0, got "
                             f"{(num_tokens, ttl_s)}")


def _check_public_blocks(public_blocks: int, whole_blocks: int) -> None:
    if not 0 <= public_blocks <= whole_blocks:
        raise ValueError(f"public_blocks {public_blocks} is not within the prompt's "
                         f"{whole_blocks} whole blocks")


def _acquire(
    loras: LoraRegistry | None, lora_request: LoRARequest | str | None
) -> tuple[str | None, tuple[int, str] | None]:
    """The identity of the adapter a request runs under (held until it retires) and its
    ``(lora_int_id, lora_name)``, or Nones."""
    if lora_request is None:
        return None, None
    if loras is None:
        name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
        raise InvalidParam("model", f"LoRA adapter {name!r} asked for, but LoRA is off "
                                    "(enable_lora, --enable-lora)")
    try:
        if isinstance(lora_request, str):
            identity, lora_request = loras.acquire_name(lora_request)
        else:
            identity = loras.acquire(lora_request)
    except (LoraBusy, LoraNotFound):
        raise  # retry later: the server's 429; the server's 404
    except ValueError as exc:
        raise InvalidParam("model", str(exc)) from None
    return identity, (lora_request.lora_int_id, lora_request.lora_name)


def _load(config: EngineConfig) -> LoadedModel:
    model = config.model
    if isinstance(model, str):
        from prefixcache.model.loader import load_model

        return load_model(model, dtype=config.dtype, weight_dtype=config.weight_dtype,
                          kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip
    if not isinstance(model, LoadedModel):
        raise ValueError(
            f"model must be a preset name, a checkpoint dir or a LoadedModel, "
            f"got {type(model).__name__}"
        )
    return model
