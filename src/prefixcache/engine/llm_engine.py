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

import torch

from prefixcache.attention.kv_cache import PagedKVCache
from prefixcache.cache import (
    CacheIdentity,
    PrefixCache,
    Sequence,
    adopt,
    evict_domain,
    make_prefix_cache,
)  # fmt: skip
from prefixcache.cache.pins import TTLS, PinTable
from prefixcache.engine.config import DEFAULT_KV_MEMORY_BYTES, EngineConfig
from prefixcache.engine.input_processor import InputProcessor
from prefixcache.engine.offload import KVOffload, Load
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.outputs import EngineLimits, EngineSnapshot, EngineView, RequestOutput
from prefixcache.engine.request import Request
from prefixcache.engine.runner import ModelRunner
from prefixcache.engine.sampler import Sampler, derive_seed, make_generator
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.step_sampling import NoTokenAllowed, StepSampler, record_prompt_logprobs
from prefixcache.engine.structured import GrammarCompiler
from prefixcache.errors import describe_exception
from prefixcache.model.config import ModelConfig
from prefixcache.model.loader import LoadedModel
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.sched import Scheduler, SchedulerOutput
from prefixcache.sched.request import RequestStatus

PERSISTENT_PIN_S = TTLS["1h"]  # a pin this long is written through to the lower tiers

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "LLMEngine"]

logger = logging.getLogger(__name__)



class LLMEngine:
    """Continuous-batching generation over a paged, prefix-cached KV pool.

    Configured by one `EngineConfig` (``engine_config``): ``model`` is a built-in name
    (``"smollm2"``, ``"tiny"``, ``"small"``), a checkpoint directory, a .gguf file or a
    `LoadedModel`. ``kv_events``: buffer the cache's KV events (bounded) for a consumer that
    drains them with `take_kv_events`; off, nothing is kept. ``num_kv_blocks=None`` sizes the
    pool from ``kv_memory_bytes``. ``check_integrity`` verifies every cache invariant after each
    step (tests). The engine leaves the process's malloc alone: ``prefixcache serve`` opts in
    to keeping freed tensor memory (`prefixcache.model.host_memory`).
    """

    def __init__(
        self, model: Any = None, *, config: EngineConfig | None = None, **settings: Any
    ) -> None:
        """``config``, or ``model`` and the flat keywords of `EngineConfig.from_kwargs`."""
        if config is None:
            config = EngineConfig.from_kwargs("tiny" if model is None else model, **settings)
        elif settings:
            raise TypeError("give an EngineConfig or keyword settings, not both")
        elif model is not None:
            config = replace(config, model=model)
        self.engine_config = config
        self.loaded: LoadedModel = _load(config.model, config.dtype, config.weight_dtype)
        self.model_config: ModelConfig = self.loaded.config
        self.tokenizer: Tokenizer = self.loaded.tokenizer
        # which kernels run the model: fixed once it is loaded and packed (`CausalLM.kernels`)
        self.kernels: dict[str, Any] = self.loaded.model.kernels()
        self.max_model_len: int = self.model_config.max_model_len
        self.block_size = config.block_size
        self.kv_layout = self.loaded.kv_layout
        num_blocks = config.cache.num_blocks or self._default_num_blocks(
            config.kv_memory_bytes, config.scheduler.max_num_seqs
        )
        self.cache: PrefixCache = make_prefix_cache(
            replace(config.cache, num_blocks=num_blocks, model_id=self.loaded.identity)
        )
        self.runner = ModelRunner(
            self.loaded.model, self.loaded.make_kv_cache(num_blocks, self.block_size)
        )
        self.scheduler: Scheduler[Request] = Scheduler(self.cache, config.scheduler)
        # the lower tiers (disk, Valkey): written behind each step, read ahead of admission
        self.offload: KVOffload | None = None
        if config.tiers.enabled and self.cache.enable_prefix_caching:
            self.offload = KVOffload.open(config.tiers, self.loaded.identity,
                                          self.runner.kv_cache, self.cache.identity)
            self.offload.emit_events = self.cache.events.enabled
            # its threads must not outlive the engine; not at exit, where waking them would run
            # tensor work while the interpreter (and torch's thread pool) is being torn down
            weakref.finalize(self, self.offload.stop).atexit = False
        self._loading: dict[str, Request] = {}  # requests whose blocks a tier is reading
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
        self._groups: dict[str, Request] = {}  # request id -> its first choice (the parent)
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._num_added = 0
        self.num_steps = 0
        self.last_scheduled: SchedulerOutput | None = None  # the latest step's batch
        # called on the engine's thread with the first choice of each finished request
        self.on_request_finished: Callable[[Request], None] | None = None

    @property
    def config(self) -> ModelConfig:
        """The model's config (older name of ``model_config``)."""
        return self.model_config

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one KV block holds for this engine's model."""
        return self.kv_layout.bytes_per_block(self.block_size)

    def _default_num_blocks(self, memory_bytes: int, max_num_seqs: int) -> int:
        """What fits in ``memory_bytes``, capped at what ``max_num_seqs`` full-length
        sequences could use."""
        fit = self.kv_layout.blocks_in(memory_bytes, self.block_size)
        return min(fit, max_num_seqs * -(-self.max_model_len // self.block_size))

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
    ) -> Request:
        """Queue a request. Bad input raises ValueError (`InvalidParam` naming the field,
        from `InputProcessor`) and leaves the engine unchanged. ``domain`` is its isolation
        domain (tenant or group) for fair sharing and caps. ``pins``: ``(num_tokens, ttl_s)``
        prefixes of the prompt to keep from eviction once the request is done (cache
        breakpoints; `PinTable`)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already running")
        token_ids = self.inputs.process(prompt, prompt_token_ids, params, domain)
        request = self._new_request(request_id, token_ids, params, cache_salt, use_cache, domain)
        if params.structured_outputs is not None:  # compiled (or refused) before it queues
            request.matcher = self.grammars.matcher(params.structured_outputs)
        if arrival_time is not None:
            request.timing.arrival_time = arrival_time
        for num_tokens, ttl_s in pins:
            if num_tokens < 0 or not ttl_s > 0:
                raise ValueError(f"a pin needs num_tokens >= 0 and ttl_s > 0, got "
                                 f"{(num_tokens, ttl_s)}")
        request.pin_requests = [(min(n, request.num_prompt_tokens - 1), t) for n, t in pins]
        self.pins.refresh(request.seq)  # a request through a pinned prefix extends the pin
        self._groups[request_id] = request
        if not self._start_load(request):
            self.scheduler.add(request)
        return request

    def _start_load(self, request: Request) -> bool:
        """Send ``request`` to the tiers' loader if its prompt runs past the RAM cache's hit
        (it then waits in ``WAITING_FOR_REMOTE_KVS``, outside the scheduler)."""
        seq = request.seq
        if self.offload is None or not seq.reads_cache:
            return False
        end = (request.num_prompt_tokens - 1) // self.block_size
        start = len(self.cache.match(seq).block_ids)
        if start >= end:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[request.request_id] = request
        self.offload.submit_load(request, start, end)
        return True

    def _admit_loaded(self) -> None:
        """Adopt the blocks the loader found into the pool and queue their requests (waiting
        a moment for one when nothing else can run)."""
        assert self.offload is not None
        idle = not self.scheduler.has_unfinished() and not self._pending
        for load in self.offload.finished_loads(timeout=0.05 if idle else 0.0):
            request = self._loading.pop(load.request.request_id, None)
            if request is not load.request:
                continue  # aborted while loading
            if load.data is not None:
                adopted = self._adopt(load)
                request.num_external_cached_tokens = adopted * self.block_size
            self.scheduler.add(request)

    def _adopt(self, load: Load) -> int:
        kv, data = self.runner.kv_cache, load.data
        assert data is not None

        def fill(block_ids: list[int], first: int) -> None:
            offset = first - load.start
            kv.write_blocks(block_ids, data[offset : offset + len(block_ids)])

        try:
            adopted = adopt(self.cache, load.request.seq, load.start, load.num_blocks, fill)
        except Exception as exc:  # noqa: BLE001 - a block that cannot be adopted is a miss
            logger.error("adopting tier blocks failed: %s", describe_exception(exc))
            return 0
        assert self.offload is not None
        self.offload.note_loaded(load, adopted)
        return adopted

    def _new_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | bytes | None,
        use_cache: bool,
        domain: str,
    ) -> Request:
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        # prompt logprobs need logits at every prompt position: compute them all (no cache
        # read), still caching the blocks for others
        seq = Sequence(request_id, token_ids, cache_salt, use_cache=use_cache, domain=domain,
                       read_cache=params.prompt_logprobs is None)
        generator = None if params.greedy else make_generator(derive_seed(base_seed, 0))
        self._num_added += 1
        request = Request(
            request_id=request_id,
            seq=seq,
            params=params,
            generator=generator,
            base_seed=base_seed,
            arrival_index=self._num_added,
            domain=domain,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        if self.offload is not None:
            request.num_external_cached_tokens = 0
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes with the next step.
        Returns False for an unknown (or already finished) request."""
        parent = self._groups.get(request_id)
        if parent is None:
            return False
        now = time.monotonic()
        self._loading.pop(request_id, None)
        for request in parent.choices:
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                request.timing.finish_time = now
                self._pending.append(self._output(request, [], []))
        self._retire_if_done(request_id)
        if self.check_integrity:
            self.cache.check_integrity()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._loading)

    def running_requests(self) -> list[Request]:
        """The choices running now (a copy; for inspection between steps)."""
        return list(self.scheduler.running)

    @property
    def kv_cache(self) -> PagedKVCache:
        """The paged KV tensors, for debugging tools."""
        return self.runner.kv_cache

    def inspect(self) -> EngineView:
        """What runs, waits and was last scheduled, and the pool's levels (between steps)."""
        cache = self.cache
        return EngineView(
            running=tuple(self.scheduler.running),
            waiting=tuple(self.scheduler.waiting),
            last_batch=self.last_scheduled,
            num_steps=self.num_steps,
            kv_cache_usage=cache.usage,
            num_free_blocks=cache.num_free_blocks,
            num_cached_blocks=cache.num_cached_blocks,
            kv_cache=self.runner.kv_cache,
        )

    def get_request(self, request_id: str) -> list[Request]:
        """The live choices of a request (empty once it finished)."""
        parent = self._groups.get(request_id)
        return parent.choices if parent is not None else []

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; returns what each touched choice gained."""
        self.pins.expire()
        if self.offload is not None:
            self._admit_loaded()
        outputs, self._pending = self._pending, []
        out = self.scheduler.schedule()
        if out.is_empty and out.admission_blocked and not self.scheduler.running:
            out = self._unblock()
        self.last_scheduled = out
        self.num_steps += 1
        if not out.is_empty:
            self._mark_scheduled(out)
            logits = self.runner.execute_step(out)
            targets = self.scheduler.update_from_step(out)
            if self.offload is not None:
                self.offload.write_behind(out)
            if logits.every_token:
                record_prompt_logprobs(out, logits)
            outputs.extend(self._sample(logits.last, targets))
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

    def _mark_scheduled(self, out: SchedulerOutput) -> None:
        now = time.monotonic()
        for chunk in out.chunks:
            timing = cast(Request, chunk.request).timing  # the scheduler holds our requests
            if timing.first_scheduled_time is None:
                timing.first_scheduled_time = now

    def _sample(
        self, logits: torch.Tensor, targets: list[tuple[Request, int]]
    ) -> list[RequestOutput]:
        """Sample, detokenize and apply stop rules per target row. A failure in any of these
        ends that row's request (finish reason ``error``); the step's other requests go on."""
        if not targets:
            return []
        rows = torch.tensor([row for _, row in targets], dtype=torch.long)
        sampled = self.step_sampler.sample(logits, rows, [r for r, _ in targets])
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for (request, _), token in zip(targets, sampled, strict=True):
            if request.is_finished:  # another choice of its request failed earlier this step
                continue
            try:
                if isinstance(token, NoTokenAllowed):
                    stopped = self.output_processor.stopped_by_grammar(request)
                    outputs.append(self._finish_output(request, stopped, [], [], now))
                    continue
                if isinstance(token, Exception):
                    raise token
                status, new_logprobs = self.output_processor.add_token(request, token, now)
                outputs.append(
                    self._finish_output(request, status, [token.token_id], new_logprobs, now)
                )
            except Exception as exc:  # noqa: BLE001 - isolated to this request, reported in it
                outputs.extend(self._fail_request(request, exc, now))
        return outputs

    def _finish_output(
        self,
        request: Request,
        status: RequestStatus | None,
        new_token_ids: list[int],
        new_logprobs: list[dict[str, Any]],
        now: float,
    ) -> RequestOutput:
        """The step's output for ``request``, ending it first where ``status`` says so."""
        if status is not None:
            self.scheduler.finish(request, status)
            request.timing.finish_time = now
        output = self._output(request, new_token_ids, new_logprobs)
        if status is not None:
            output.request_finished = self._retire_if_done(request.request_id)
        return output

    def _fail_request(self, request: Request, exc: Exception, now: float) -> list[RequestOutput]:
        """End every unfinished choice of ``request``'s group with finish reason ``error``."""
        # the type and code location only: an exception's message may quote prompt text
        message = f"the request failed inside the engine: {describe_exception(exc)}"
        logger.error("request %s failed: %s", request.request_id, describe_exception(exc))
        parent = self._groups.get(request.request_id)
        outputs = []
        for choice in parent.choices if parent is not None else [request]:
            if choice.is_finished:
                continue
            self.scheduler.finish(choice, RequestStatus.FINISHED_ERROR)
            choice.timing.finish_time = now
            output = self._output(choice, [], [])
            output.error = message
            outputs.append(output)
        if outputs:
            outputs[-1].request_finished = self._retire_if_done(request.request_id)
        return outputs

    def _output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list[dict[str, Any]]
    ) -> RequestOutput:
        done = self._group_done(request.request_id)
        return self.output_processor.output(request, new_token_ids, new_logprobs, done)

    def _group_done(self, request_id: str) -> bool:
        parent = self._groups.get(request_id)
        return parent is None or parent.all_finished

    def _pin(self, seq: Sequence, num_tokens: int, ttl_s: float) -> None:
        """Pin ``seq``'s prefix; a pin of an hour or more also writes it through to the lower
        tiers (`KVOffload.write_through`), where they keep it past a restart."""
        pin = self.pins.pin(seq, num_tokens, ttl_s)
        if pin is not None and self.offload is not None and ttl_s >= PERSISTENT_PIN_S:
            self.offload.write_through(pin.seq, self.cache.block_table(pin.seq))

    def _retire_if_done(self, request_id: str) -> bool:
        if not self._group_done(request_id):
            return False
        parent = self._groups.pop(request_id, None)
        if parent is not None:
            if parent.pin_requests and parent.finish_reason in ("stop", "length"):
                for num_tokens, ttl_s in parent.pin_requests:
                    self._pin(parent.seq, num_tokens, ttl_s)
            self.output_processor.record(parent)
            if self.on_request_finished is not None:
                self.on_request_finished(parent)
        return True

    # ---- cache control and stats ----------------------------------------------------------------

    @property
    def limits(self) -> EngineLimits:
        """What this engine accepts (for a server's request validation)."""
        return EngineLimits(
            max_num_seqs=self.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            block_size=self.block_size,
            num_kv_blocks=self.cache.num_blocks,
            precision=self.precision,
        )

    @property
    def precision(self) -> dict[str, Any]:
        """What the model runs in: activations and KV ``dtype``, how the projections keep their
        ``weights``, which ``kernels`` run them (`CausalLM.kernels`: the GEMM, the attention
        path, whether a row's result is batch invariant), and what ``--dtype auto`` measured
        where it chose them."""
        loaded = self.loaded
        dtype = str(loaded.dtype).removeprefix("torch.")
        out: dict[str, Any] = {"dtype": dtype, "weights": loaded.weight_dtype or dtype,
                               "precision": loaded.precision,
                               "kernels": dict(self.kernels)}  # fmt: skip
        if loaded.choice is not None:
            out["dtype_auto"] = loaded.choice.as_dict()
        return out

    def snapshot(self) -> EngineSnapshot:
        """Counters and levels now (call between steps, on the engine's thread)."""
        stats = self.cache.stats
        free = self.cache.num_free_blocks
        return EngineSnapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.cache.usage,
            num_free_blocks=free,
            min_free_blocks=stats.min_free_blocks if stats.min_free_blocks >= 0 else free,
            num_blocks=self.cache.num_blocks,
            num_cached_free_blocks=sum(self.cache.pool.free_cached_by_domain().values()),
            num_cached_blocks=self.cache.num_cached_blocks,
            num_pinned_blocks=sum(p.num_blocks for p in self.pins.pins.values()),
            num_steps=self.num_steps,
            last_step_tokens=sum(c.num_new_tokens for c in self.last_scheduled.chunks)
            if self.last_scheduled is not None else 0,
            queried_tokens=stats.num_queried_tokens,
            hit_tokens=stats.num_hit_tokens,
            evictions=stats.num_evictions,
            preemptions=self.scheduler.num_preemptions,
            duplicate_blocks=stats.num_duplicate_blocks,
        )

    @property
    def cache_identity(self) -> CacheIdentity:
        """What names this engine's cache blocks."""
        return self.cache.identity

    def prompt_block_digests(self, request: Request) -> list[bytes]:
        """The digests of ``request``'s complete prompt blocks (what a trace records)."""
        num_blocks = request.num_prompt_tokens // self.block_size
        return self.cache.identity.block_digests(request.seq)[:num_blocks]

    def take_kv_events(self) -> list[Any]:
        """Drain the KV events buffered since the last call (empty unless ``kv_events``): the
        cache's, then the shared tier's (`BlockStored` with ``medium="VALKEY"``)."""
        events = self.cache.take_events()
        if self.offload is not None and self.offload.emit_events:
            events += self.offload.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, pinned ones included (``num_pins_released_by_reset`` says
        how many pins went); refused (False, nothing changed) while requests hold blocks."""
        self.num_pins_released_by_reset = 0
        if self.scheduler.has_unfinished() or self._loading:
            return False
        pins = list(self.pins.pins.values())
        self.pins.release_all()
        if not self.cache.reset():
            for pin in pins:  # not reset after all: hold them again
                self.pins.pin(pin.seq, pin.num_tokens, pin.ttl_s)
            return False
        self.num_pins_released_by_reset = len(pins)
        return True

    def stats(self) -> dict[str, Any]:
        """Cache counters, scheduler counters and per-request timing of finished requests."""
        stats = self.cache.stats
        return {
            "hit_tokens": stats.num_hit_tokens,
            "queried_tokens": stats.num_queried_tokens,
            "queries": stats.num_requests,
            "hit_requests": stats.num_hit_requests,
            "hit_rate": stats.hit_rate,
            "evictions": stats.num_evictions,
            "preemptions": self.scheduler.num_preemptions,
            "deferred_by_dedup": self.scheduler.num_deferred,
            "num_steps": self.num_steps,
            "num_kv_blocks": self.cache.num_blocks,
            "num_free_blocks": self.cache.num_free_blocks,
            "kv_cache_usage": self.cache.usage,
            "ttft": {rid: h["ttft"] for rid, h in self.output_processor.history.items()},
            "requests": dict(self.output_processor.history),
            "cache": stats.as_dict(),
            "tiers": self.offload.stats_dict() if self.offload is not None else None,
        }

    def purge_domain(self, domain: str) -> dict[str, int]:
        """Remove ``domain``'s blocks from every lower tier (records removed per tier); thread
        safe, it does not touch the RAM cache (`drop_domain`)."""
        return self.offload.store.purge_domain(domain) if self.offload is not None else {}

    def drop_domain(self, domain: str) -> int:
        """Evict ``domain``'s free cached blocks from the RAM cache and zero their KV (between
        steps, on the engine's thread); returns how many."""
        block_ids = evict_domain(self.cache, domain)
        self.runner.kv_cache.zero_blocks(block_ids)
        if self.check_integrity:
            self.cache.check_integrity()
        return len(block_ids)

    def flush_tiers(self, timeout: float = 30.0) -> bool:
        """Wait until the blocks queued for the lower tiers are written (False on timeout)."""
        return self.offload.flush(timeout) if self.offload is not None else True

    def close(self) -> None:
        """Finish the tiers' queued writes and stop their threads (idempotent)."""
        if self.offload is not None:
            self.offload.close()


def _load(model: Any, dtype: str, weight_dtype: str = "auto") -> LoadedModel:
    if isinstance(model, str):
        from prefixcache.model.loader import load_model

        return load_model(model, dtype=dtype, weight_dtype=weight_dtype)
    if not isinstance(model, LoadedModel):
        raise ValueError(
            f"model must be a preset name, a checkpoint dir or a LoadedModel, "
            f"got {type(model).__name__}"
        )
    return model
