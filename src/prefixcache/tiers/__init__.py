"""Lower KV tiers under the block pool: a disk directory and a Valkey server (torch-free).

A `TieredStore` puts one identity's block records in every tier and finds the longest run of a
prompt's blocks across them, nearest tier first; a block a farther tier served is copied into the
nearer ones. The engine drives it from its worker threads (`prefixcache.engine.offload`); the
record format and the file and key layouts are in ``docs/tiers.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache.tiers.base import KVTier, TierStats
from prefixcache.tiers.disk import DiskTier
from prefixcache.tiers.record import BadRecord, BlockKey, TierIdentity, domain_tag, token_check

__all__ = [
    "BadRecord",
    "BlockKey",
    "DiskTier",
    "KVTier",
    "TierConfig",
    "TierIdentity",
    "TierStats",
    "TieredStore",
    "domain_tag",
    "token_check",
]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The lower tiers of an engine (none by default). ``disk_dir`` with ``disk_gib`` of
    capacity; ``valkey_url`` with an optional ``valkey_ttl_s``; ``offload_prompt_only``: write
    prompt blocks only (else decode blocks too, as they fill); blocks waiting to be written take
    at most ``max_pending_bytes`` of memory (or ``max_pending_blocks`` blocks, if given), beyond
    which new ones are dropped and counted."""

    disk_dir: str | None = None
    disk_gib: float = 16.0
    valkey_url: str | None = None
    valkey_ttl_s: int | None = None
    offload_prompt_only: bool = True
    max_pending_blocks: int | None = None
    max_pending_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.disk_gib <= 0:
            raise ValueError(f"--kv-disk-gib must be > 0, got {self.disk_gib}")
        if self.max_pending_blocks is not None and self.max_pending_blocks < 1:
            raise ValueError(f"max_pending_blocks must be >= 1, got {self.max_pending_blocks}")
        if self.max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be >= 1, got {self.max_pending_bytes}")
        if self.valkey_ttl_s is not None and self.valkey_ttl_s < 1:
            raise ValueError(f"--kv-valkey-ttl must be >= 1 s, got {self.valkey_ttl_s}")

    def pending_blocks(self, block_bytes: int) -> int:
        """How many blocks of ``block_bytes`` may wait for the writer."""
        if self.max_pending_blocks is not None:
            return self.max_pending_blocks
        return max(1, self.max_pending_bytes // block_bytes)

    @property
    def enabled(self) -> bool:
        return self.disk_dir is not None or self.valkey_url is not None


class TieredStore:
    """The tiers of one identity, nearest first."""

    def __init__(self, identity: TierIdentity, tiers: Sequence[KVTier]) -> None:
        self.identity = identity
        self.tiers = list(tiers)

    @classmethod
    def open(cls, identity: TierIdentity, config: TierConfig) -> TieredStore:
        tiers: list[KVTier] = []
        if config.disk_dir is not None:
            tiers.append(DiskTier(Path(config.disk_dir), identity, int(config.disk_gib * GIB)))
        if config.valkey_url is not None:
            from prefixcache.tiers.valkey import ValkeyTier

            tiers.append(ValkeyTier(config.valkey_url, identity, ttl_s=config.valkey_ttl_s))
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
            payloads += got
            sources += [tier.name] * len(got)
        return payloads, sources

    def store(self, items: Sequence[tuple[BlockKey, bytes | memoryview]]) -> set[bytes]:
        """Write ``items`` to every tier that does not hold them yet. Returns the digests a
        shared tier (Valkey: every engine on the server reads it) now holds."""
        shared: set[bytes] = set()
        if not items:
            return shared
        digests = [key.digest for key, _ in items]
        for tier in self.tiers:
            held = tier.contains(digests)
            todo = [item for item, h in zip(items, held, strict=True) if not h]
            if todo:
                tier.put(todo)
            if tier.shared and tier.stats.up:
                shared.update(digests)
        return shared

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
