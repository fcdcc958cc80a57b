"""What an engine shows of itself: its limits and precision (fixed at load), its counters and
levels now (`EngineSnapshot`), what runs and waits (`EngineView`), and the offline API's
``stats()`` dict. Read between steps, on the engine's thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from prefixcache.cache import PrefixCache
from prefixcache.cache.pins import PinTable
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.outputs import EngineLimits, EngineSnapshot, EngineView
from prefixcache.engine.request import Request
from prefixcache.engine.runner import ModelRunner
from prefixcache.engine.tiering import TierTraffic
from prefixcache.sched import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from prefixcache.attention.kv_cache import KVLayout
    from prefixcache.model.config import ModelConfig
    from prefixcache.model.loader import LoadedModel


class Observed(Protocol):
    """The parts of an engine (`LLMEngine`) this module reads."""

    loaded: LoadedModel
    kernels: dict[str, Any]
    kv_layout: KVLayout
    model_config: ModelConfig
    max_model_len: int
    block_size: int
    cache: PrefixCache
    scheduler: Scheduler[Request]
    runner: ModelRunner
    pins: PinTable
    tiers: TierTraffic | None
    output_processor: OutputProcessor
    num_steps: int
    last_scheduled: SchedulerOutput | None

__all__ = [
    "Observed", "kv_cache_of", "limits_of", "precision_of", "snapshot_of", "stats_of", "view_of",
]  # fmt: skip


def precision_of(
    loaded: LoadedModel, kernels: dict[str, Any], kv_layout: KVLayout | None = None
) -> dict[str, Any]:
    """What the model runs in: activations ``dtype``, how the projections keep their
    ``weights``, which ``kernels`` run them (`CausalLM.kernels`: the GEMM, the attention path,
    whether a row's result is batch invariant), what ``--dtype auto`` measured where it chose
    them, and how the paged KV cache keeps K and V (``kv_cache``, `kv_cache_of`)."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    out: dict[str, Any] = {"dtype": dtype, "weights": loaded.weight_dtype or dtype,
                           "precision": loaded.precision, "kernels": dict(kernels)}  # fmt: skip
    if loaded.choice is not None:
        out["dtype_auto"] = loaded.choice.as_dict()
    out["kv_cache"] = kv_cache_of(loaded, kv_layout or loaded.kv_layout)
    return out


def kv_cache_of(loaded: LoadedModel, layout: KVLayout) -> dict[str, Any]:
    """The KV cache's layout: its name (``dtype``), what the cache namespace and tier records
    name (``layout``), bytes per token over all layers, and its fidelity against float32 KV
    where it was measured (``kv_auto``: ``--kv-cache-dtype auto``'s choice; ``fidelity``: the
    layout's own figures, `precision.fidelity_of`)."""
    found = layout.format
    out: dict[str, Any] = {"dtype": found.name, "layout": found.layout,
                           "bytes_per_token": layout.bytes_per_block(1)}  # fmt: skip
    measured = loaded.kv_measured
    if measured is not None:
        if measured.auto:
            out["kv_auto"] = measured.as_dict()
        if found.name in measured.fidelity:
            out["fidelity"] = dict(measured.fidelity[found.name])
    return out


def limits_of(engine: Observed) -> EngineLimits:
    """What ``engine`` accepts (for a server's request validation)."""
    return EngineLimits(
        max_num_seqs=engine.scheduler.max_num_seqs,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        block_size=engine.block_size,
        num_kv_blocks=engine.cache.num_blocks,
        precision=precision_of(engine.loaded, engine.kernels, engine.kv_layout),
    )


def view_of(engine: Observed) -> EngineView:
    cache = engine.cache
    return EngineView(
        running=tuple(engine.scheduler.running),
        waiting=tuple(engine.scheduler.waiting),
        last_batch=engine.last_scheduled,
        num_steps=engine.num_steps,
        kv_cache_usage=cache.usage,
        num_free_blocks=cache.num_free_blocks,
        num_cached_blocks=cache.num_cached_blocks,
        kv_cache=engine.runner.kv_cache,
        cache=cache,
    )


def snapshot_of(engine: Observed) -> EngineSnapshot:
    cache, scheduler = engine.cache, engine.scheduler
    stats = cache.stats
    size = cache.size()
    last = engine.last_scheduled
    return EngineSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=size.usage,
        num_free_blocks=size.num_free,
        min_free_blocks=stats.min_free_blocks if stats.min_free_blocks >= 0 else size.num_free,
        num_blocks=size.num_blocks,
        num_cached_free_blocks=sum(cache.pool.free_cached_by_domain().values()),
        num_cached_blocks=size.num_cached,
        num_pinned_blocks=sum(p.num_blocks for p in engine.pins.pins.values()),
        num_steps=engine.num_steps,
        last_step_tokens=sum(c.num_new_tokens for c in last.chunks) if last is not None else 0,
        queried_tokens=stats.num_queried_tokens,
        hit_tokens=stats.num_hit_tokens,
        evictions=stats.num_evictions,
        preemptions=scheduler.num_preemptions,
        duplicate_blocks=stats.num_duplicate_blocks,
        prefill_s_per_token=engine.runner.prefill_speed.s_per_token,
        queued_prefill_tokens=_queued_prefill_tokens(engine),
    )


def _queued_prefill_tokens(engine: Observed) -> int:
    """Prompt tokens not computed yet of the requests running, waiting or waiting for a tier's
    blocks (those count whole: what the tier serves is not known yet)."""
    scheduler, tiers = engine.scheduler, engine.tiers
    loading = tiers.loading.values() if tiers is not None else ()
    return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0)
               for queue in (scheduler.waiting, scheduler.running, loading) for r in queue)


def stats_of(engine: Observed) -> dict[str, Any]:
    """Cache counters, scheduler counters and per-request timing of finished requests: the
    offline API's ``stats()``, from the same counters as `snapshot_of`."""
    snap = snapshot_of(engine)
    stats, history, tiers = engine.cache.stats, engine.output_processor.history, engine.tiers
    return {
        "hit_tokens": snap.hit_tokens,
        "queried_tokens": snap.queried_tokens,
        "queries": stats.num_requests,
        "hit_requests": stats.num_hit_requests,
        "hit_rate": stats.hit_rate,
        "evictions": snap.evictions,
        "preemptions": snap.preemptions,
        "deferred_by_dedup": engine.scheduler.num_deferred,
        "num_steps": snap.num_steps,
        "num_kv_blocks": snap.num_blocks,
        "num_free_blocks": snap.num_free_blocks,
        "kv_cache_usage": snap.kv_cache_usage,
        "ttft": {rid: h["ttft"] for rid, h in history.items()},
        "requests": dict(history),
        "cache": stats.as_dict(),
        "tiers": tiers.offload.stats_dict() if tiers is not None else None,
    }
