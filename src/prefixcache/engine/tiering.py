"""The engine's traffic with the lower tiers (disk, Valkey): requests whose prompt runs past the
RAM hit wait while the loader reads their blocks, which are then adopted into the pool; each
step's new blocks are written behind; a long pin is written through. `KVOffload` moves the
bytes on its threads; this class is the engine-thread side of it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefixcache.cache import PrefixCache, Sequence, adopt
from prefixcache.cache.events import KVCacheEvent
from prefixcache.cache.pins import TTLS
from prefixcache.engine.offload import KVOffload, Load
from prefixcache.engine.request import Request
from prefixcache.errors import describe_exception
from prefixcache.sched import Scheduler, SchedulerOutput
from prefixcache.sched.request import RequestStatus
from prefixcache.tiers import TierConfig

if TYPE_CHECKING:
    from prefixcache.attention.kv_cache import PagedKVCache

__all__ = ["PERSISTENT_PIN_S", "TierTraffic"]

PERSISTENT_PIN_S = TTLS["1h"]  # a pin this long is written through to the lower tiers

logger = logging.getLogger(__name__)


class TierTraffic:
    """Between ``cache`` (with ``kv_cache``, its tensors) and ``offload``'s tiers; requests go
    on to ``scheduler`` once their blocks are in."""

    def __init__(self, offload: KVOffload, cache: PrefixCache, kv_cache: PagedKVCache,
                 scheduler: Scheduler[Request]) -> None:  # fmt: skip
        self.offload = offload
        self.cache = cache
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.loading: dict[str, Request] = {}  # requests whose blocks a tier is reading

    @classmethod
    def open(
        cls, config: TierConfig, model_identity: str, cache: PrefixCache,
        kv_cache: PagedKVCache, scheduler: Scheduler[Request],
    ) -> TierTraffic | None:  # fmt: skip
        """The tiers ``config`` names under ``cache`` (None: no tier, or nothing is cached)."""
        if not (config.enabled and cache.enable_prefix_caching):
            return None
        offload = KVOffload.open(config, model_identity, kv_cache, cache.identity)
        if cache.events.enabled:
            offload.start_events()
        fates = cache.allocator.fates
        if fates is not None:  # a record failing its checks when read: a block's fate
            for tier in offload.store.tiers:
                tier.stats.on_bad = fates.tier_failed
        return cls(offload, cache, kv_cache, scheduler)

    def start_load(self, request: Request) -> bool:
        """Send ``request`` to the loader if its prompt runs past the RAM cache's hit (it then
        waits in ``WAITING_FOR_REMOTE_KVS``, outside the scheduler)."""
        seq = request.seq
        if not seq.reads_cache:
            return False
        end = (request.num_prompt_tokens - 1) // self.cache.block_size
        start = len(self.cache.match(seq).block_ids)
        if start >= end:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        self.offload.submit_load(request, start, end)
        return True

    def admit_loaded(self, idle: bool) -> None:
        """Adopt the blocks the loader found into the pool and queue their requests (waiting
        a moment for one when the engine is ``idle``)."""
        for load in self.offload.finished_loads(timeout=0.05 if idle else 0.0):
            request = self.loading.pop(load.request.request_id, None)
            if request is not load.request:
                continue  # aborted while loading
            if load.data is not None:
                adopted = self._adopt(load)
                request.num_external_cached_tokens = adopted * self.cache.block_size
            self.scheduler.add(request)

    def _adopt(self, load: Load) -> int:
        kv, data = self.kv_cache, load.data
        assert data is not None

        def fill(block_ids: list[int], first: int) -> None:
            offset = first - load.start
            kv.write_blocks(block_ids, data[offset : offset + len(block_ids)])

        try:
            adopted = adopt(self.cache, load.request.seq, load.start, load.num_blocks, fill)
        except Exception as exc:  # noqa: BLE001 - a block that cannot be adopted is a miss
            logger.error("adopting tier blocks failed: %s", describe_exception(exc))
            return 0
        self.offload.note_loaded(load, adopted)
        return adopted

    def write_behind(self, out: SchedulerOutput) -> None:
        self.offload.write_behind(out)

    def pinned(self, seq: Sequence, ttl_s: float) -> None:
        """``seq`` (a pin's stand-in) was pinned for ``ttl_s``: an hour or more is written
        through, so the tiers keep it past a restart."""
        if ttl_s >= PERSISTENT_PIN_S:
            self.offload.write_through(seq, self.cache.block_table(seq))

    def take_events(self) -> list[KVCacheEvent]:
        """The tiers' events (`BlockStored`, `BlockRemoved` with the tier's medium: ``"DISK"``,
        ``"VALKEY"``), if they are announced."""
        if not self.offload.emit_events:
            return []
        return self.offload.take_events()

    def purge_domain(self, domain: str) -> dict[str, int]:
        return self.offload.store.purge_domain(domain)
