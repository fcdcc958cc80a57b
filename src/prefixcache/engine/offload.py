"""`KVOffload`: the engine's traffic with its lower KV tiers, on two threads of its own.

Write-behind: after a step commits, the prompt blocks it completed (all blocks with
``kv_offload_decode``) are copied out of the paged KV cache on the engine's thread — one
gather per layer — and queued; a writer thread encodes and stores them in every tier. The queue
is bounded in blocks: a step that would overfill it drops its blocks and counts them, it never
waits. Load-ahead: a new request whose prompt runs past the RAM cache's hit is handed to a loader
thread, which reads the longest run of its next blocks from the tiers (nearest first), each
record checked against the block's identity, digest, parent, token check and checksum; the
engine adopts the run into freshly allocated pool blocks at its next step
(`prefixcache.cache.adopt`). Neither thread ever blocks the step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prefixcache.attention.kv_cache import PagedKVCache
from prefixcache.cache import (
    PUBLIC_DOMAIN,
    BlockRemoved,
    BlockStored,
    CacheIdentity,
    KVCacheEvent,
    Sequence,
)
from prefixcache.errors import describe_exception
from prefixcache.tiers import BlockKey, TierConfig, TieredStore, TierIdentity, domain_tag
from prefixcache.tiers import token_check as make_token_check

if TYPE_CHECKING:
    from prefixcache.sched import SchedulerOutput

__all__ = ["KVOffload", "Load", "tier_identity"]

logger = logging.getLogger(__name__)

_KNOWN_STORED = 1 << 18  # digests remembered as written (skipped by the write-behind)


def tier_identity(model_id: str, kv: PagedKVCache, identity: CacheIdentity) -> TierIdentity:
    """What names this engine's blocks at rest: the model identity and the KV's own shape and
    layout (`prefixcache.attention.kv_format`: records are stored as the cache holds them)."""
    layout = kv.kv_format
    return TierIdentity(
        model_id=model_id, kv_dtype=layout.name,
        num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
        block_size=identity.block_size, hash_algo=identity.hash_algo,
        element_size=torch.empty((), dtype=layout.storage).element_size(),
        kv_layout=layout.layout if layout.quantized else "",
        row_bytes=layout.row_bytes(kv.head_dim) if layout.quantized else 0,
    )  # fmt: skip


@dataclass(eq=False)
class Load:
    """Blocks ``start ..`` of ``request``'s prompt, asked of the tiers; the loader fills
    ``data`` ([blocks, 2 * layers, block_size, kv_heads, head_dim]) and ``sources``."""

    request: Any  # the engine's Request
    start: int
    keys: list[BlockKey]
    data: torch.Tensor | None = None
    sources: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.sources)


@dataclass(slots=True)
class OffloadStats:
    """The engine side of the tiers (the tiers count their own reads and writes)."""

    blocks_queued: int = 0  # blocks copied out for the writer
    blocks_dropped: int = 0  # blocks not queued: the write queue was full
    blocks_written_through: int = 0  # queued for a long-lived pin (`write_through`)
    write_copy_seconds: float = 0.0  # engine-thread time spent copying blocks out
    loads: int = 0  # requests sent to the loader
    blocks_loaded: int = 0  # blocks adopted into the pool from a tier
    blocks_loaded_by_tier: dict[str, int] = field(default_factory=dict)
    load_failures: int = 0  # loads that failed inside the engine (counted, served as misses)


class KVOffload:
    """Write-behind and load-ahead between ``kv_cache`` and ``store``."""

    def __init__(
        self, store: TieredStore, kv_cache: PagedKVCache, identity: CacheIdentity,
        config: TierConfig,
    ) -> None:  # fmt: skip
        self.store = store
        self.kv_cache = kv_cache
        self.identity = identity
        self.config = config
        self.stats = OffloadStats()
        self.max_pending = config.pending_blocks(store.identity.payload_bytes)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._pending = 0  # blocks queued or being written
        self._pending_lock = threading.Lock()
        self._writes: queue.SimpleQueue[tuple[list[BlockKey], torch.Tensor] | None] = (
            queue.SimpleQueue()
        )
        self._loads: queue.SimpleQueue[Load | None] = queue.SimpleQueue()
        self._done: queue.Queue[Load] = queue.Queue()
        self._num_loading = 0
        self._closed = False
        # the tiers' KV events (`BlockStored`/`BlockRemoved` with the tier's medium, for a
        # cache-aware router), filled by the writer and loader threads once `emit_events` and
        # drained by `take_events`
        self._events: list[KVCacheEvent] = []
        self._events_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader",
                                        daemon=True)
        self._writer.start()
        self._loader.start()

    @classmethod
    def open(
        cls, config: TierConfig, model_id: str, kv_cache: PagedKVCache, identity: CacheIdentity
    ) -> KVOffload:
        store = TieredStore.open(tier_identity(model_id, kv_cache, identity), config)
        return cls(store, kv_cache, identity, config)

    @property
    def emit_events(self) -> bool:
        return self.store.on_stored is not None

    def start_events(self) -> None:
        """Announce from now on what each tier stores and evicts (`take_events`)."""
        self.store.watch(self._note_stored, self._note_removed)

    @property
    def num_pending_writes(self) -> int:
        return self._pending

    @property
    def num_loading(self) -> int:
        return self._num_loading

    def keys(self, seq: Sequence, start: int, end: int) -> list[BlockKey]:
        """The tier keys of ``seq``'s blocks ``start .. end - 1``."""
        return self._keys(seq, range(start, end))

    def _keys(self, seq: Sequence, indices: SequenceABC[int]) -> list[BlockKey]:
        digests = self.identity.block_digests(seq)
        token_bytes = seq.block_token_bytes
        # a public block is the public domain's: a tenant's purge leaves it to the others
        tag, public_tag = domain_tag(seq.domain), domain_tag(PUBLIC_DOMAIN)
        num_public = seq.public_blocks
        root = self.identity.root(seq) if indices and indices[0] == 0 else b""
        out = []
        for i in indices:
            parent = digests[i - 1] if i else root
            check = make_token_check(parent, token_bytes[i])
            out.append(BlockKey(digests[i], parent, check, public_tag if i < num_public else tag,
                                seq.lora))
        return out

    # -- load-ahead --------------------------------------------------------------------------------

    def submit_load(self, request: Any, start: int, end: int) -> None:
        """Ask the tiers for blocks ``start .. end - 1`` of ``request``'s prompt."""
        self.stats.loads += 1
        self._num_loading += 1
        self._loads.put(Load(request, start, self.keys(request.seq, start, end)))

    def finished_loads(self, timeout: float = 0.0) -> list[Load]:
        """The loads done since the last call (waiting up to ``timeout`` for the first)."""
        out = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self._num_loading -= len(out)
        return out

    def _load_loop(self) -> None:
        layout = self.kv_cache
        shape = (2 * layout.num_layers, layout.block_size, layout.num_kv_heads, layout.row_width)
        while (load := self._loads.get()) is not None:
            try:
                payloads, sources = self.store.load_run(load.keys)
                if payloads:
                    raw = bytearray(b"".join(payloads))
                    load.data = torch.frombuffer(raw, dtype=layout.storage_dtype).view(-1, *shape)
                    load.sources = sources
            except Exception as exc:  # noqa: BLE001 - a failed load is a miss, never a crash
                logger.error("KV tier load failed: %s", describe_exception(exc))
                self.stats.load_failures += 1
                load.data, load.sources = None, []
            self._done.put(load)

    def note_loaded(self, load: Load, num_adopted: int) -> None:
        """``num_adopted`` of ``load``'s blocks went into the pool (the last ones it served)."""
        stats = self.stats
        stats.blocks_loaded += num_adopted
        for name in load.sources[load.num_blocks - num_adopted :]:
            stats.blocks_loaded_by_tier[name] = stats.blocks_loaded_by_tier.get(name, 0) + 1
        for key in load.keys[: load.num_blocks]:
            self._remember(key.digest)

    # -- write-behind ------------------------------------------------------------------------------

    def write_behind(self, out: SchedulerOutput) -> None:
        """Queue the blocks ``out``'s chunks completed (called after the step's commit)."""
        start_t = time.perf_counter()
        bs = self.kv_cache.block_size
        for chunk in out.chunks:
            request = chunk.request
            seq = request.seq
            if not seq.writes_cache:
                continue
            limit = request.num_prompt_tokens if not self.config.kv_offload_decode else len(
                seq.token_ids)
            first = chunk.num_computed_tokens // bs
            last = min(chunk.num_computed_tokens + chunk.num_new_tokens, limit) // bs
            if last <= first:
                continue
            digests = self.identity.block_digests(seq)
            todo = [i for i in range(first, last) if digests[i] not in self._known]
            if not todo:
                continue
            with self._pending_lock:
                fits = self._pending + len(todo) <= self.max_pending
                if fits:
                    self._pending += len(todo)
            if not fits:
                self.stats.blocks_dropped += len(todo)
                continue
            data = self.kv_cache.read_blocks([chunk.block_table[i] for i in todo])
            keys = self._keys(seq, todo)
            for key in keys:
                self._remember(key.digest)
            self.stats.blocks_queued += len(todo)
            self._writes.put((keys, data))
        self.stats.write_copy_seconds += time.perf_counter() - start_t

    def write_through(self, seq: Sequence, block_ids: list[int]) -> int:
        """Queue ``seq``'s first ``len(block_ids)`` blocks (held in ``block_ids``) for every tier,
        past the queue's bound and whether or not the write-behind wrote them before: a
        long-lived pin's prefix is then at rest even if an earlier write was dropped or the
        tier evicted it since (the tiers skip what they hold). Returns the blocks queued."""
        if not block_ids or not seq.writes_cache:
            return 0
        indices = range(len(block_ids))
        keys = self._keys(seq, indices)
        data = self.kv_cache.read_blocks(block_ids)
        with self._pending_lock:
            self._pending += len(keys)
        for key in keys:
            self._remember(key.digest)
        self.stats.blocks_queued += len(keys)
        self.stats.blocks_written_through += len(keys)
        self._writes.put((keys, data))
        return len(keys)

    def _remember(self, digest: bytes) -> None:
        known = self._known
        known[digest] = None
        known.move_to_end(digest)
        if len(known) > _KNOWN_STORED:
            known.popitem(last=False)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            keys, data = item
            try:
                raw = data.contiguous().view(torch.uint8).view(len(keys), -1).numpy()
                self.store.store([(key, memoryview(raw[i])) for i, key in enumerate(keys)])
            except Exception as exc:  # noqa: BLE001 - a failed write is dropped, never a crash
                logger.error("KV tier write failed: %s", describe_exception(exc))
            finally:
                with self._pending_lock:
                    self._pending -= len(keys)

    def _note_stored(self, medium: str, keys: list[BlockKey]) -> None:
        """One `BlockStored` per chained run of ``keys`` of one adapter, which tier ``medium``
        now holds (with the adapter's ``lora_id`` and ``lora_name``, as the RAM's events)."""
        bs = self.kv_cache.block_size
        runs: list[list[BlockKey]] = []
        for key in keys:
            last = runs[-1][-1] if runs else None
            if last is not None and key.parent == last.digest and key.lora == last.lora:
                runs[-1].append(key)
            else:
                runs.append([key])
        events = [_stored(run, bs, medium) for run in runs]
        with self._events_lock:
            self._events += events

    def _note_removed(self, medium: str, digests: list[bytes]) -> None:
        with self._events_lock:
            self._events.append(BlockRemoved(list(digests), medium=medium))

    def take_events(self) -> list[KVCacheEvent]:
        """The tiers' events since the last call."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pending

    def stop(self) -> None:
        """Ask both threads to end once what is queued is done, without waiting (idempotent).
        An engine dropped without `close` calls this: the threads then let go of the KV tensors
        they would otherwise keep alive for the rest of the process."""
        if self._closed:
            return
        self._closed = True
        self._writes.put(None)
        self._loads.put(None)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), stop both threads, close the tiers."""
        if self._closed and not self._writer.is_alive() and not self._loader.is_alive():
            return
        self.stop()
        self._writer.join(timeout)
        self._loader.join(timeout)
        self.store.close()

    def stats_dict(self) -> dict[str, Any]:
        """The engine's and every tier's counters, as plain data."""
        engine = {name: getattr(self.stats, name) for name in OffloadStats.__dataclass_fields__}
        engine["blocks_loaded_by_tier"] = dict(self.stats.blocks_loaded_by_tier)
        engine["pending_writes"] = self._pending
        engine["loading"] = self._num_loading
        tiers = {}
        for tier in self.store.tiers:  # with what each holds, where the tier knows it (disk)
            tiers[tier.name] = {**tier.stats.as_dict(),
                                "blocks_held": getattr(tier, "num_blocks", None),
                                "bytes_held": getattr(tier, "num_bytes", None),
                                "capacity_bytes": getattr(tier, "capacity_bytes", None)}
        return {"engine": engine, "tiers": tiers}


def _stored(run: list[BlockKey], block_size: int, medium: str) -> BlockStored:
    lora_id, lora_name = run[0].lora or (None, None)
    return BlockStored([k.digest for k in run], run[0].parent, [], block_size, medium=medium,
                       lora_id=lora_id, lora_name=lora_name)  # fmt: skip
