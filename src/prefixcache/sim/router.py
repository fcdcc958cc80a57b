"""Routers that pick a replica for each request in cluster mode.

A router sees only what a real one would: the request's block digests, the replicas' current
loads (requests in flight), the request's affinity ``key`` if it has one (OpenAI's
``prompt_cache_key``, scoped to its tenant by the ingress: never part of a block's identity) and,
for ``cache-aware``, the KV events the replicas publish (it keeps its own mirror of each
replica's cached digests). A key is combined with the prompt's prefix (the digest of its first
``k`` blocks), as OpenAI routes: requests with one key and one prefix go to one replica, and one
prefix under different keys may spread. Knows nothing about scheduling or time.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable

from prefixcache.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)


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


class CacheAware(Router):
    """Longest cached prefix from the replicas' KV events, unless load is out of balance.

    Like SGLang's router: when ``max_load - min_load > abs_threshold`` and ``max_load >
    rel_threshold * min_load`` the request goes to the least-loaded replica; otherwise to the
    replica holding the longest prefix (no match at all: least-loaded, then fewest blocks cached
    or expected).

    A replica's blocks are what its events stored, plus what it was just sent: a routed
    request's digests are *expected* there until the replica's events store or remove them, so
    requests that share a prefix and arrive before the first one's blocks are committed follow it
    (as SGLang's router inserts at routing time). At most ``max_expected`` digests are expected per
    replica, the oldest forgotten first (a request that never committed cannot pin a prefix).
    Blocks a replica stored in a shared tier (an event with a ``medium``: Valkey)
    count as held by every replica: any of them loads them instead of computing (at most
    ``max_shared`` remembered, the oldest forgotten first: the tier evicts silently).

    A request with an affinity ``key`` that no replica holds any of goes where the key and its
    first ``k`` blocks hash to (not the least loaded one), so the requests of one key gather on
    one replica before any of them has committed; among replicas holding equally long prefixes,
    the same replica wins the tie. The load guard still comes first.
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
    ) -> None:
        super().__init__(num_replicas, seed)
        self.max_shared = max_shared
        self.shared: OrderedDict[bytes, None] = OrderedDict()
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.max_expected = max_expected
        self.mirrors: list[set[bytes]] = [set() for _ in range(num_replicas)]
        self.expected: list[dict[bytes, None]] = [{} for _ in range(num_replicas)]
        self.k = 4  # the prefix an affinity key is combined with, in blocks
        self._ring = _Ring(num_replicas)

    @property
    def wants_events(self) -> bool:
        return True

    def observe(self, replica: int, events: list[KVCacheEvent]) -> None:
        mirror, expected = self.mirrors[replica], self.expected[replica]
        for event in events:
            if isinstance(event, BlockStored) and event.medium is not None:
                shared = self.shared
                for digest in event.block_hashes:
                    shared[digest] = None
                    shared.move_to_end(digest)
                while len(shared) > self.max_shared:
                    shared.popitem(last=False)
                continue
            if isinstance(event, (BlockStored, BlockRemoved)):
                for digest in event.block_hashes:
                    expected.pop(digest, None)
                if isinstance(event, BlockStored):
                    mirror.update(event.block_hashes)
                else:
                    mirror.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                mirror.clear()
                expected.clear()

    def forget(self, replica: int) -> None:
        self.mirrors[replica].clear()
        self.expected[replica].clear()

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
        matched = [self._matched(i, digests) for i in range(self.num_replicas)]
        best = max(matched)
        point = None if key is None else affinity_point(digests, self.k, key)
        owner = -1 if point is None else self._ring.owner(point)
        if best == 0:
            if owner >= 0:
                return owner
            return min(range(self.num_replicas),
                       key=lambda i: (loads[i], len(self.mirrors[i]) + len(self.expected[i])))
        return min((i for i in range(self.num_replicas) if matched[i] == best),
                   key=lambda i: (i != owner, loads[i]))

    def _matched(self, replica: int, digests: list[bytes]) -> int:
        mirror, expected, shared = self.mirrors[replica], self.expected[replica], self.shared
        n = 0
        for digest in digests:
            if digest not in mirror and digest not in expected and digest not in shared:
                break
            n += 1
        return n


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


ROUTERS: dict[str, Callable[..., Router]] = {
    cls.name: cls for cls in (RoundRobin, RandomRouter, LeastLoaded, PrefixAffinity, CacheAware)
}


def make_router(name: str, num_replicas: int, seed: int = 0) -> Router:
    """A router by name; ValueError naming the choices for an unknown one."""
    factory = ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    return factory(num_replicas, seed)
