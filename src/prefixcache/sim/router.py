"""Routers that pick a replica for each request in cluster mode.

A router sees only what a real one would: the request's block digests, the replicas' current
loads (requests in flight), the request's affinity ``key`` if it has one (OpenAI's
``prompt_cache_key``, scoped to its tenant by the ingress: never part of a block's identity) and,
for ``cache-aware``, the KV events the replicas publish (it keeps its own mirror of each
replica's cached digests, per KV pool and tier) and what each replica measured a prefill and a
load from each tier to cost (`ReplicaCosts`). A key is combined with the prompt's prefix (the
digest of its first ``k`` blocks), as OpenAI routes: requests with one key and one prefix go to
one replica, and one prefix under different keys may spread. Knows nothing about scheduling or
time.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable

from prefixcache.cache.events import AllBlocksCleared, BlockStored, KVCacheEvent
from prefixcache.sim.replica_costs import ReplicaCosts
from prefixcache.tiers import TIERS


class Router:
    """Base: ``choose`` a replica index; ``observe`` a replica's KV events (ignored here)."""

    name = "base"
    # the rule reads the digests' bytes, not only their equality with the replicas' events
    reads_digest_bytes = False

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self._next = 0

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        """The replica for a request with these block ``digests``; ``key``: its affinity key."""
        raise NotImplementedError

    def choose_for(self, digests: list[bytes], recorded: list[bytes], loads: list[int]) -> int:
        """``choose`` in a replay: a rule that reads digest bytes gets the ones a recorded trace
        kept (``recorded``: what the serving router saw), so it decides as that router did;
        the others get the replay's own, which the replicas' events name."""
        return self.choose(recorded if recorded and self.reads_digest_bytes else digests, loads)

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        """Replica ``replica`` published ``events``."""

    def forget(self, replica: int) -> None:
        """Replica ``replica`` was replaced by an empty one (its cache is gone)."""

    def set_costs(self, replica: int, costs: ReplicaCosts) -> None:
        """What replica ``replica`` measured its prefill and tier loads to cost (ignored
        here)."""

    @property
    def wants_events(self) -> bool:
        return False

    def least_loaded(self, loads: list[int]) -> int:
        """Lowest load; ties rotate so equal replicas share the work."""
        n = self.num_replicas
        start = self._next
        self._next = (start + 1) % n
        return min(range(n), key=lambda i: (loads[i], (i - start) % n))


class RoundRobin(Router):
    name = "round-robin"

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        chosen = self._next
        self._next = (chosen + 1) % self.num_replicas
        return chosen


class RandomRouter(Router):
    name = "random"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas, seed)
        self._rng = random.Random(seed)

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        return self._rng.randrange(self.num_replicas)


class LeastLoaded(Router):
    name = "least-loaded"

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        return self.least_loaded(loads)


class _Ring:
    """Consistent hashing of keys onto replicas (``vnodes`` points each)."""

    def __init__(self, num_replicas: int, vnodes: int = 64) -> None:
        ring = sorted(
            (_point(f"replica-{r}-{v}".encode()), r)
            for r in range(num_replicas)
            for v in range(vnodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def owner(self, data: bytes) -> int:
        index = bisect.bisect(self._points, _point(data)) % len(self._points)
        return self._owners[index]


def affinity_point(digests: list[bytes], k: int, key: bytes | None) -> bytes | None:
    """What a request hashes to for affinity: its first ``k`` blocks' digest (which chains all
    of them), combined with its ``key`` when it has one; None when it has neither."""
    prefix = digests[min(k, len(digests)) - 1] if digests else b""
    if key is None:
        return prefix or None
    return hashlib.blake2b(prefix, digest_size=16, key=key[:64]).digest()


class PrefixAffinity(Router):
    """Consistent hashing on the digest of the first ``k`` blocks (which chains all of them),
    combined with the request's affinity key when it has one."""

    name = "prefix-affinity"
    reads_digest_bytes = True

    def __init__(self, num_replicas: int, seed: int = 0, k: int = 4, vnodes: int = 64) -> None:
        super().__init__(num_replicas, seed)
        if k < 1:
            raise ValueError(f"prefix-affinity k must be >= 1, got {k}")
        self.k = k
        self._ring = _Ring(num_replicas, vnodes)

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        point = affinity_point(digests, self.k, key)
        if point is None:  # no complete block and no key: nothing to be affine to
            return self.least_loaded(loads)
        return self._ring.owner(point)


class TierHoldings:
    """The digests a router believes held per tier medium, each an LRU of at most ``max_blocks``
    (the oldest forgotten first: a tier may drop blocks without saying so)."""

    __slots__ = ("max_blocks", "media")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.media: dict[str, OrderedDict[bytes, None]] = {}

    def store(self, medium: str, digests: list[bytes]) -> None:
        held = self.media.setdefault(medium, OrderedDict())
        for digest in digests:
            held[digest] = None
            held.move_to_end(digest)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def remove(self, medium: str, digests: list[bytes]) -> None:
        held = self.media.get(medium)
        if held is None:
            return
        for digest in digests:
            held.pop(digest, None)

    def clear(self) -> None:
        self.media.clear()

    def counts(self) -> dict[str, int]:
        return {medium: len(held) for medium, held in self.media.items()}


# which tier media every replica reads (Valkey); any other medium is one replica's own
_SHARED_MEDIA = frozenset(kind.medium for kind in TIERS.values() if kind.shared)


class CacheAware(Router):
    """The replica whose cache and tiers save the most prefill, unless load is out of balance.

    Like SGLang's router: when ``max_load - min_load > abs_threshold`` and ``max_load >
    rel_threshold * min_load`` the request goes to the least-loaded replica. Otherwise each
    replica's *credit* is the run of the prompt's blocks it holds, from the first, each block
    weighted by where it is (`ReplicaCosts.weight`: 1 in the KV pool, ``1 - load / prefill`` in
    a lower tier, from what the replica measured and exported, `set_costs`); the request goes
    where ``backlog_s + prefill_s_per_block * (blocks - credit)`` is least: the prefill left to
    do there, after the work queued ahead of it. Equal estimates (a prefix only a shared tier
    holds, or one every replica holds alike) go to the *owner*: the replica the request's first
    ``k`` blocks (and its affinity key, if any) hash to, as prefix-affinity routes, then the
    least loaded, then the one with fewest blocks cached or expected. So a conversation whose
    history is equally far from every replica stays on one, and its blocks are not written to
    every replica's own tier (going by load there spread them over both disks and lost 0.009 of
    the Mooncake conversation trace's hit ratio in the simulator). No credit anywhere and no
    key: new work, the least loaded, then the fewest blocks cached or expected; with a key, its
    owner. With no costs reported (the same prefill speed everywhere, no backlog) this is the
    longest weighted prefix.

    A replica's blocks are what its events stored, per medium (`BlockStored.medium`): the KV
    pool (None), its own tiers (``"DISK"``), and shared tiers (``"VALKEY"``), whose blocks every
    replica holds (any of them loads them). A `BlockRemoved` removes a block from its medium
    only, so a block evicted from the pool but kept on disk still counts, at the disk's weight;
    `AllBlocksCleared` clears the pool (a reset leaves the tiers). A routed request's digests
    are *expected* in the pool of the replica it went to until that replica's events store or
    remove them, so requests that share a prefix and arrive before the first one's blocks are
    committed follow it (as SGLang's router inserts at routing time); at most ``max_expected``
    per replica, the oldest forgotten first. A tier's holdings are bounded too
    (``max_tier_blocks`` per replica and tier, ``max_shared`` per shared tier): a tier may evict
    silently, and a stale entry costs one routing choice, never a wrong answer.

    So the requests of one key (or one first ``k`` blocks) gather on one replica before any of
    them has committed. The load guard still comes first.
    """

    name = "cache-aware"

    def __init__(
        self,
        num_replicas: int,
        seed: int = 0,
        abs_threshold: int = 16,
        rel_threshold: float = 1.5,
        max_expected: int = 4096,
        max_shared: int = 1 << 20,
        max_tier_blocks: int = 1 << 20,
    ) -> None:
        super().__init__(num_replicas, seed)
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.max_expected = max_expected
        self.mirrors: list[set[bytes]] = [set() for _ in range(num_replicas)]  # the KV pools
        self.expected: list[dict[bytes, None]] = [{} for _ in range(num_replicas)]
        self.tiers = [TierHoldings(max_tier_blocks) for _ in range(num_replicas)]
        self.shared = TierHoldings(max_shared)
        self.costs = [ReplicaCosts() for _ in range(num_replicas)]
        self.k = 4  # the prefix an affinity key is combined with, in blocks
        self._ring = _Ring(num_replicas)

    @property
    def wants_events(self) -> bool:
        return True

    def set_costs(self, replica: int, costs: ReplicaCosts) -> None:
        self.costs[replica] = costs

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        mirror, expected = self.mirrors[replica], self.expected[replica]
        for event in events:
            if isinstance(event, AllBlocksCleared):
                mirror.clear()
                expected.clear()
                continue
            medium = event.medium
            if medium is not None:
                holdings = self.shared if medium in _SHARED_MEDIA else self.tiers[replica]
                if isinstance(event, BlockStored):
                    holdings.store(medium, event.block_hashes)
                else:
                    holdings.remove(medium, event.block_hashes)
                continue
            for digest in event.block_hashes:
                expected.pop(digest, None)
            if isinstance(event, BlockStored):
                mirror.update(event.block_hashes)
            else:
                mirror.difference_update(event.block_hashes)

    def forget(self, replica: int) -> None:
        self.mirrors[replica].clear()
        self.expected[replica].clear()
        self.tiers[replica].clear()
        self.costs[replica] = ReplicaCosts()

    def held_blocks(self, replica: int) -> dict[str, int]:
        """How many blocks the router believes ``replica`` holds, per medium (``"POOL"``, its
        own tiers, the shared ones)."""
        return {"POOL": len(self.mirrors[replica]), **self.tiers[replica].counts(),
                **self.shared.counts()}

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        chosen = self._choose(digests, loads, key)
        expected = self.expected[chosen]
        for digest in digests:
            if digest not in self.mirrors[chosen]:
                expected.pop(digest, None)
                expected[digest] = None  # newest last
        while len(expected) > self.max_expected:
            del expected[next(iter(expected))]
        return chosen

    def _choose(self, digests: list[bytes], loads: list[int], key: bytes | None) -> int:
        low, high = min(loads), max(loads)
        if high - low > self.abs_threshold and high > self.rel_threshold * low:
            return self.least_loaded(loads)
        replicas = range(self.num_replicas)
        credits = [self.credit(i, digests) for i in replicas]
        point = affinity_point(digests, self.k, key)
        owner = -1 if point is None else self._ring.owner(point)
        if max(credits) <= 0.0 and key is None:  # nothing of it anywhere: new work, least loaded
            return min(replicas,
                       key=lambda i: (loads[i], len(self.mirrors[i]) + len(self.expected[i])))
        seconds = self._estimates(len(digests), credits)
        best = min(seconds)
        tolerance = 1e-9 * max(1.0, abs(best))
        return min((i for i in replicas if seconds[i] <= best + tolerance),
                   key=lambda i: (i != owner, loads[i],
                                  len(self.mirrors[i]) + len(self.expected[i])))

    def _estimates(self, num_blocks: int, credits: list[float]) -> list[float]:
        """Each replica's prefill left to do for the request plus its backlog, in seconds (in
        blocks where no replica reported its prefill speed)."""
        known = [c.prefill_s_per_block for c in self.costs if c.prefill_s_per_block]
        default = sum(known) / len(known) if known else 1.0
        return [cost.backlog_s + (cost.prefill_s_per_block or default) * (num_blocks - credit)
                for cost, credit in zip(self.costs, credits, strict=True)]

    def credit(self, replica: int, digests: list[bytes]) -> float:
        """The prefill, in blocks, ``replica`` saves on ``digests``: the run it holds from the
        first block, each block weighted by the nearest medium holding it."""
        mirror, expected = self.mirrors[replica], self.expected[replica]
        media = [*self.tiers[replica].media.items(), *self.shared.media.items()]
        weights = [self.costs[replica].weight(medium) for medium, _ in media]
        credit = 0.0
        for digest in digests:
            if digest in mirror or digest in expected:
                credit += 1.0
                continue
            weight = max((w for (_, held), w in zip(media, weights, strict=True)
                          if digest in held), default=None)
            if weight is None:
                break
            credit += weight
        return credit

    def _matched(self, replica: int, digests: list[bytes]) -> int:
        """How many of ``digests``, from the first, ``replica`` holds anywhere."""
        mirror, expected = self.mirrors[replica], self.expected[replica]
        media = [*self.tiers[replica].media.values(), *self.shared.media.values()]
        n = 0
        for digest in digests:
            if digest not in mirror and digest not in expected and not any(
                digest in held for held in media
            ):
                break
            n += 1
        return n


class CacheAwareTierBlind(CacheAware):
    """`CacheAware` as a router that indexes only the KV pool scores a prefix: the events of the
    lower tiers are ignored, so a block evicted from the pool counts as not cached even where a
    disk or Valkey still holds it (SGLang's router, and Ray's KV-aware router over LMCache:
    "an offloaded prefix scored as though it weren't cached"). Costs, backlog, expected blocks
    and the load guard are `CacheAware`'s."""

    name = "cache-aware-tier-blind"

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        super().observe(replica, [e for e in events if getattr(e, "medium", None) is None])


class RayPrefixAware(Router):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` rules over block digests instead of
    characters (its tree keys the prompt's text; a digest chains its whole prefix, so the run of
    a prompt's digests a replica was sent is the prefix it matches there).

    Each replica's *tree* holds every block of every request routed to it, inserted when it is
    routed and never told of an eviction (Ray's eviction is off by default and, when on, trims by
    size, not by what the replica dropped). When ``max_load - min_load > imbalanced_threshold``
    (Ray's default: infinite, never) the request goes to the less loaded of two replicas drawn
    at random (power of two choices). Otherwise the *match rate* is the longest run any replica
    matches over the prompt's blocks: at or above ``match_rate_threshold`` (0.1) the candidates
    are the replicas matching that run, below it the replicas holding the fewest blocks; the
    least loaded candidate wins (the first of them on a tie, as Ray's)."""

    name = "ray-prefix-aware"

    def __init__(
        self,
        num_replicas: int,
        seed: int = 0,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
    ) -> None:
        super().__init__(num_replicas, seed)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.trees: list[set[bytes]] = [set() for _ in range(num_replicas)]
        self._rng = random.Random(seed)

    def forget(self, replica: int) -> None:
        self.trees[replica].clear()

    def choose(self, digests: list[bytes], loads: list[int], key: bytes | None = None) -> int:
        chosen = self._choose(digests, loads)
        self.trees[chosen].update(digests)
        return chosen

    def _choose(self, digests: list[bytes], loads: list[int]) -> int:
        if not digests or max(loads) - min(loads) > self.imbalanced_threshold:
            pair = self._rng.sample(range(self.num_replicas), min(2, self.num_replicas))
            return min(pair, key=lambda i: loads[i])
        runs = [_run_held(tree, digests) for tree in self.trees]
        best = max(runs)
        if best / len(digests) >= self.match_rate_threshold:
            candidates = [i for i, run in enumerate(runs) if run == best]
        else:
            fewest = min(len(tree) for tree in self.trees)
            candidates = [i for i, tree in enumerate(self.trees) if len(tree) == fewest]
        return min(candidates, key=lambda i: loads[i])  # as Ray's: the first of the least loaded


def _run_held(held: set[bytes], digests: list[bytes]) -> int:
    """How many of ``digests``, from the first, ``held`` holds."""
    n = 0
    for digest in digests:
        if digest not in held:
            break
        n += 1
    return n


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


ROUTERS: dict[str, Callable[..., Router]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomRouter, LeastLoaded, PrefixAffinity, CacheAware,
                CacheAwareTierBlind, RayPrefixAware)
}


def make_router(name: str, num_replicas: int, seed: int = 0) -> Router:
    """A router by name; ValueError naming the choices for an unknown one."""
    factory = ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    return factory(num_replicas, seed)
