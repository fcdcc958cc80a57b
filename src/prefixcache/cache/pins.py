"""Pinned prefixes: cached blocks kept from eviction for a time (Anthropic's ``cache_control``).

A pin holds one reference on each block of a prompt's prefix, through a stand-in sequence the
cache keeps live (`hold`), so the blocks leave the free queue exactly as a running
request's do: no eviction can take them, and they count as the pinning domain's blocks in the
scheduler's fair shares. A pin ends at its expiry (``ttl_s`` after it was made or last hit, on
the table's ``clock``, which tests control) or when released; its references are dropped then
and the blocks become evictable again, most recently used. Each domain may pin at most
``max_blocks_per_domain`` blocks: a new pin over the budget releases that domain's oldest pins
first, never another domain's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.base import PrefixCache
from prefixcache.cache.sequence import Sequence

__all__ = ["MAX_TTL_S", "TTLS", "Pin", "PinTable", "hold", "ttl_seconds"]

TTLS = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}  # the named TTLs the APIs take
MAX_TTL_S = TTLS["24h"]


def ttl_seconds(value: object) -> float | None:
    """A TTL given by name (``5m``, ``1h``, ``24h``) or in seconds, in ``(0, 1 day]``; None
    for anything else."""
    seconds = TTLS.get(value) if isinstance(value, str) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None
    return float(seconds) if 0 < seconds <= MAX_TTL_S else None


def hold(cache: PrefixCache, seq: Sequence, num_blocks: int) -> int:
    """Take a reference on the cached blocks among ``seq``'s first ``num_blocks`` (from the
    first, as far as they are cached), computing nothing and counting no lookup. ``seq`` is
    then live, its blocks out of every free queue; ``cache.free(seq)`` lets them go. Returns how
    many blocks it holds (0: none cached, or ``seq`` is live already)."""
    if not cache.writes(seq) or seq.seq_id in cache.tables:
        return 0
    if num_blocks > (len(seq.token_ids) - 1) // cache.block_size:
        raise ValueError(f"hold: {num_blocks} blocks leave no token of {seq.seq_id!r}")
    hit = cache.index.lookup(seq)
    if not hit.block_ids:
        return 0
    if len(hit.block_ids) > num_blocks:  # a longer sequence than the blocks asked for
        raise ValueError(f"hold: give {seq.seq_id!r} num_blocks * block_size + 1 tokens")
    hit.epoch = cache.pool.epoch
    block_ids = cache.allocator.first(seq, 0, hit, counted=False)
    return 0 if block_ids is None else len(block_ids)


@dataclass(slots=True, eq=False)
class Pin:
    """``num_blocks`` blocks of a prefix, held until ``expires_at`` (the table's clock)."""

    pin_id: str
    seq: Sequence  # the stand-in the cache holds the blocks for
    domain: str
    num_blocks: int
    ttl_s: float
    expires_at: float
    last_digest: bytes  # the pinned prefix's last block: a request through it refreshes the pin
    num_tokens: int = 0


class PinTable:
    """The engine's pins over ``cache``."""

    def __init__(
        self, cache: PrefixCache, max_blocks_per_domain: int,
        clock: Callable[[], float] = time.monotonic, budgets: Mapping[str, int] | None = None,
    ) -> None:  # fmt: skip
        """``budgets``: per-domain budgets that replace ``max_blocks_per_domain``."""
        if max_blocks_per_domain < 0 or any(b < 0 for b in (budgets or {}).values()):
            raise ValueError("pin budgets must be >= 0")
        self.cache = cache
        self.max_blocks_per_domain = max_blocks_per_domain
        self.budgets = dict(budgets or {})
        self.clock = clock
        self.pins: dict[str, Pin] = {}  # in creation order: the oldest first
        self._ids = itertools.count(1)
        self.num_made = 0  # pins created (not refreshes of an existing one)
        self.num_expired = 0
        self.num_evicted_for_budget = 0
        self.num_yielded = 0  # released so that a request could start (`yield_to`)

    def budget(self, domain: str) -> int:
        """How many blocks ``domain`` may pin."""
        return self.budgets.get(domain, self.max_blocks_per_domain)

    def describe(self, domain: str) -> list[dict[str, Any]]:
        """``domain``'s pins as plain data: id, tokens, TTL, seconds left, last block digest."""
        now = self.clock()
        return [{"id": p.pin_id, "num_tokens": p.num_tokens, "ttl_s": p.ttl_s,
                 "expires_in_s": round(max(0.0, p.expires_at - now), 3),
                 "last_block_digest": p.last_digest.hex()} for p in self.of_domain(domain)]

    def blocks_pinned(self, domain: str) -> int:
        return sum(p.num_blocks for p in self.pins.values() if p.domain == domain)

    def pin(self, seq: Sequence, num_tokens: int, ttl_s: float) -> Pin | None:
        """Pin the cached blocks of ``seq``'s first ``num_tokens`` tokens (whole blocks) for
        ``ttl_s`` seconds; None when none of them is cached or the budget is 0. An existing pin
        of the same prefix and domain is refreshed instead (its TTL the longer of the two)."""
        bs = self.cache.block_size
        budget = self.budget(seq.domain)
        num_blocks = min(num_tokens // bs, budget)
        if num_blocks < 1:
            return None
        digests = self.cache.identity.block_digests(seq)
        if len(digests) < num_blocks:
            return None
        for pin in self.pins.values():
            if pin.domain == seq.domain and pin.last_digest == digests[num_blocks - 1]:
                pin.ttl_s = max(pin.ttl_s, ttl_s)
                pin.expires_at = max(pin.expires_at, self.clock() + ttl_s)
                return pin
        while self.blocks_pinned(seq.domain) + num_blocks > budget:
            oldest = next(p for p in self.pins.values() if p.domain == seq.domain)
            self.release(oldest.pin_id)
            self.num_evicted_for_budget += 1
        pin_id = f"pin_{next(self._ids)}"
        stand_in = Sequence(f"\x00{pin_id}", seq.token_ids[: num_blocks * bs + 1], seq.salt,
                            adapter=seq.adapter, domain=seq.domain,
                            public_blocks=min(seq.public_blocks, num_blocks))
        held = hold(self.cache, stand_in, num_blocks)
        if held == 0:
            return None
        pin = Pin(pin_id, stand_in, seq.domain, held, ttl_s, self.clock() + ttl_s,
                  digests[held - 1], held * bs)
        self.pins[pin_id] = pin
        self.num_made += 1
        return pin

    def refresh(self, seq: Sequence) -> None:
        """A request of ``seq``'s domain reached the cache: pins of prefixes it runs through
        start their TTL again (Anthropic refreshes a cache entry on each hit)."""
        if not self.pins:
            return
        mine = [p for p in self.pins.values() if p.domain == seq.domain]
        if not mine:
            return
        digests = set(self.cache.identity.block_digests(seq))
        now = self.clock()
        for pin in mine:
            if pin.last_digest in digests:
                pin.expires_at = max(pin.expires_at, now + pin.ttl_s)

    def expire(self) -> int:
        """Release every pin past its expiry; returns how many."""
        if not self.pins:
            return 0
        now = self.clock()
        done = [pin_id for pin_id, p in self.pins.items() if p.expires_at <= now]
        for pin_id in done:
            self._note_unpinned(self.pins[pin_id], expired=True)
            self.release(pin_id)
        self.num_expired += len(done)
        return len(done)

    def release(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        self.cache.free(pin.seq)
        return True

    def yield_to(self, domain: str) -> bool:
        """A request of ``domain`` cannot start beside the pinned blocks and nothing running
        will free any: release the oldest pin of another domain, else ``domain``'s oldest.
        False when there is no pin left."""
        if not self.pins:
            return False
        pin = next((p for p in self.pins.values() if p.domain != domain),
                   next(iter(self.pins.values())))
        self._note_unpinned(pin, expired=False)
        self.release(pin.pin_id)
        self.num_yielded += 1
        return True

    def _note_unpinned(self, pin: Pin, expired: bool) -> None:
        """Tell the cache's fates (diagnostics) why ``pin``'s blocks are no longer held."""
        fates = self.cache.allocator.fates
        if fates is not None:
            fates.unpinned(pin.seq.block_digests[: pin.num_blocks], expired)

    def release_all(self) -> int:
        ids = list(self.pins)
        for pin_id in ids:
            self.release(pin_id)
        return len(ids)

    def reset_cache(self) -> int | None:
        """Reset the cache, every pin released first: how many pins went, or None (nothing
        changed, the pins held again) when the cache refused."""
        pins = list(self.pins.values())
        self.release_all()
        if not self.cache.reset():
            for pin in pins:  # not reset after all: hold them again
                self.pin(pin.seq, pin.num_tokens, pin.ttl_s)
            return None
        return len(pins)

    def of_domain(self, domain: str) -> list[Pin]:
        return [p for p in self.pins.values() if p.domain == domain]
