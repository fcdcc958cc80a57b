"""Lower KV tiers under the block pool: a disk directory and a Valkey server (torch-free).

A `TieredStore` puts one identity's block records in every tier and finds the longest run of a
prompt's blocks across them, nearest tier first; a block a farther tier served is copied into the
nearer ones. The engine drives it from its worker threads (`prefixcache.engine.offload`); the
record format and the file and key layouts are in ``docs/tiers.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prefixcache.tiers import disk, valkey
from prefixcache.tiers.base import KVTier, TierKind, TierStats
from prefixcache.tiers.disk import DiskTier
from prefixcache.tiers.record import BadRecord, BlockKey, TierIdentity, domain_tag, token_check

__all__ = [
    "TIERS",
    "BadRecord",
    "BlockKey",
    "DiskTier",
    "KVTier",
    "TierConfig",
    "TierIdentity",
    "TierKind",
    "TierStats",
    "TieredStore",
    "domain_tag",
    "token_check",
]

# every kind of tier, nearest first: a new tier is its module (a `TierKind`) and one line here
TIERS: dict[str, TierKind] = {
    "disk": disk.KIND,
    "valkey": valkey.KIND,
}


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The lower tiers of an engine (none by default). ``settings`` holds the tiers' flags by
    destination (``kv_disk``, ``kv_disk_gib``, ``kv_valkey``, ``kv_valkey_ttl``: what `TIERS`
    defines); a tier is on where its location (``kv_<name>``) is set. The writer's settings are
    the engine's flags too: ``kv_offload_decode`` writes decode blocks as they fill (else prompt
    blocks only); blocks waiting to be written take at most ``kv_offload_max_pending_bytes`` of
    memory (or ``kv_offload_max_pending_blocks`` blocks, if given), beyond which new ones are
    dropped and counted."""

    settings: Mapping[str, object] = field(default_factory=dict)
    kv_offload_decode: bool = False
    kv_offload_max_pending_blocks: int | None = None
    kv_offload_max_pending_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        known = {dest for kind in TIERS.values() for dest in kind.dests}
        unknown = sorted(set(self.settings) - known)
        if unknown:
            raise TypeError(f"unknown tier setting(s): {', '.join(unknown)}")
        for kind in TIERS.values():
            kind.check(self.settings)
        blocks, num_bytes = self.kv_offload_max_pending_blocks, self.kv_offload_max_pending_bytes
        if blocks is not None and blocks < 1:
            raise ValueError(f"kv_offload_max_pending_blocks must be >= 1, got {blocks}")
        if num_bytes < 1:
            raise ValueError(f"kv_offload_max_pending_bytes must be >= 1, got {num_bytes}")

    def location(self, kind: TierKind) -> str | None:
        value = self.settings.get(kind.dest)
        return None if value is None else str(value)

    def kinds(self) -> list[TierKind]:
        """The tiers that are on, nearest first."""
        return [kind for kind in TIERS.values() if self.location(kind) is not None]

    def pending_blocks(self, block_bytes: int) -> int:
        """How many blocks of ``block_bytes`` may wait for the writer."""
        if self.kv_offload_max_pending_blocks is not None:
            return self.kv_offload_max_pending_blocks
        return max(1, self.kv_offload_max_pending_bytes // block_bytes)

    @property
    def enabled(self) -> bool:
        return bool(self.kinds())


class TieredStore:
    """The tiers of one identity, nearest first.

    ``watch`` names listeners for what the tiers hold: ``on_stored(medium, keys)`` after blocks
    were written to (or found in) a tier, in the keys' order; ``on_removed(medium, digests)``
    after a tier evicted blocks to keep its capacity. They are called on the thread that
    stores, loads or evicts. ``medium`` is the tier's `TierKind.medium` (``"DISK"``). A shared
    tier that drops blocks silently (Valkey's own eviction, a TTL) reports no removal."""

    def __init__(self, identity: TierIdentity, tiers: Sequence[KVTier]) -> None:
        self.identity = identity
        self.tiers = list(tiers)
        self.on_stored: Callable[[str, list[BlockKey]], None] | None = None

    def watch(self, on_stored: Callable[[str, list[BlockKey]], None],
              on_removed: Callable[[str, list[bytes]], None]) -> None:  # fmt: skip
        self.on_stored = on_stored
        for tier in self.tiers:
            tier.stats.on_removed = lambda digests, m=tier.name.upper(): on_removed(m, digests)

    @classmethod
    def open(cls, identity: TierIdentity, config: TierConfig) -> TieredStore:
        tiers = [kind.open(config.location(kind) or "", identity, config.settings)
                 for kind in config.kinds()]
        return cls(identity, tiers)

    def __repr__(self) -> str:
        return f"TieredStore({self.tiers!r})"

    def load_run(self, keys: list[BlockKey]) -> tuple[list[memoryview], list[str]]:
        """The payloads of the longest run of ``keys`` held across the tiers, and the tier that
        served each. Blocks a farther tier served are written to the nearer ones."""
        payloads: list[memoryview] = []
        sources: list[str] = []
        for i, tier in enumerate(self.tiers):
            if len(payloads) == len(keys):
                break
            start = len(payloads)
            got = tier.get_run(keys[start:])
            if got and i:
                promoted = list(zip(keys[start : start + len(got)], got, strict=True))
                for nearer in self.tiers[:i]:
                    nearer.put(promoted)
                    self._announce(nearer, [key for key, _ in promoted])
            payloads += got
            sources += [tier.name] * len(got)
        return payloads, sources

    def store(
        self, items: Sequence[tuple[BlockKey, bytes | memoryview]]
    ) -> dict[str, set[bytes]]:
        """Write ``items`` to every tier that does not hold them yet. Returns, per tier, its
        medium (`TierKind.medium`) and the digests it now holds (all of them for a shared tier
        that is up: one every engine using it reads, Valkey)."""
        media: dict[str, set[bytes]] = {}
        if not items:
            return media
        digests = [key.digest for key, _ in items]
        for tier in self.tiers:
            held = tier.contains(digests)
            todo = [item for item, h in zip(items, held, strict=True) if not h]
            if todo:
                tier.put(todo)
            keys = self._announce(tier, [key for key, _ in items])
            if keys:
                media[tier.name.upper()] = {key.digest for key in keys}
        return media

    def _announce(self, tier: KVTier, keys: list[BlockKey]) -> list[BlockKey]:
        """Those of ``keys`` ``tier`` holds now (a shared tier: all, if it is up), told to
        ``on_stored``."""
        if tier.shared:
            held = keys if tier.stats.up else []
        else:  # the disk's own index: what a refused write left out is not there
            found = tier.contains([key.digest for key in keys])
            held = [key for key, h in zip(keys, found, strict=True) if h]
        if held and self.on_stored is not None:
            self.on_stored(tier.name.upper(), held)
        return held

    def purge_domain(self, domain: str) -> dict[str, int]:
        """Remove one isolation domain's blocks from every tier: records removed per tier.
        Every tier is tried; if one cannot be reached, `ConnectionError` says which, after the
        others are purged."""
        tag = domain_tag(domain)
        removed: dict[str, int] = {}
        failed = []
        for tier in self.tiers:
            try:
                removed[tier.name] = tier.purge_domain(tag)
            except ConnectionError:
                failed.append(tier.name)
        if failed:
            done = ", ".join(f"{name}: {n} records" for name, n in removed.items()) or "none"
            raise ConnectionError(f"the {' and '.join(failed)} tier could not be reached "
                                  f"(purged {done}); retry")
        return removed

    def stats(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats for tier in self.tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
