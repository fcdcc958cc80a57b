"""What the live dashboard shows, gathered where it happens and read as one JSON document.

`CacheView` is a `CacheObserver` on the engine's thread: at each admission it records the
request's first-miss position and its reason, adds the request's prompt chain to a bounded map of
recently seen blocks (digest -> parent, requests through it, sequences holding it now), and counts
the domain's queried and hit tokens. It never keeps token ids or text: a block is its digest, a
tenant its metrics label (name, digest or ``all``, as ``/metrics`` shows it). `dashboard_data`
folds that view, the engine's latest snapshot (the same one ``/metrics`` reads) and the metrics'
histograms into the document ``GET /dashboard/data`` serves.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from prefixcache.cache import CacheHit, CacheIdentity, Sequence
from prefixcache.server.protocol import JSONObject

if TYPE_CHECKING:
    from prefixcache.engine.outputs import EngineSnapshot
    from prefixcache.server.metrics import ServerMetrics

__all__ = ["CacheView", "dashboard_data"]

MAX_NODES = 4096  # blocks remembered for the tree, least recently seen forgotten first
MAX_RECENT = 40  # admissions listed
MAX_TREE_ROOTS = 8  # prefixes drawn
MAX_TREE_NODES = 160


@dataclass(slots=True)
class _Node:
    parent: bytes | None
    depth: int  # blocks from the namespace root, this one included
    domain: str  # the metrics label of the namespace's domain
    requests: int = 0  # admissions whose prompt ran through this block
    live: int = 0  # sequences holding it now (its reference count from requests)
    children: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class Admission:
    """One admitted request, as the cache saw it."""

    t: float
    domain: str
    prompt_tokens: int
    cached_tokens: int
    first_miss_block: int  # index of the first block it computes
    reason: str  # full-hit | new-prefix | diverged | evicted-or-in-flight | cache-off


class CacheView:
    """The engine-side part of the dashboard (``label``: domain -> its metrics label)."""

    def __init__(self, identity: CacheIdentity, label: Callable[[str], str]) -> None:
        self.identity = identity
        self.block_size = identity.block_size
        self.label = label
        self._lock = threading.Lock()
        self._nodes: OrderedDict[bytes, _Node] = OrderedDict()
        self._held: dict[str, list[bytes]] = {}  # seq id -> the chain it holds
        self.recent: deque[Admission] = deque(maxlen=MAX_RECENT)
        self.domains: dict[str, list[int]] = {}  # label -> [queried tokens, hit tokens]

    # -- CacheObserver (the engine's thread) ---------------------------------------------------

    def on_admit(self, seq: Sequence, hit: CacheHit | None, block_ids: list[int]) -> None:
        if seq.seq_id.startswith("\x00"):
            return  # a pin's stand-in, not a request
        domain = self.label(seq.domain)
        num_hit = len(hit.block_ids) if hit is not None else 0
        reads = seq.reads_cache
        digests = self.identity.block_digests(seq) if seq.writes_cache else []
        num_prompt_blocks = min(len(digests), len(seq.token_ids) // self.block_size)
        chain = digests[:num_prompt_blocks]
        with self._lock:
            reason = self._reason(reads, num_hit, chain, len(seq.token_ids))
            self.recent.append(Admission(round(time.time(), 3), domain, len(seq.token_ids),
                                         num_hit * self.block_size, num_hit, reason))
            counts = self.domains.setdefault(domain, [0, 0])
            counts[0] += len(seq.token_ids)
            counts[1] += num_hit * self.block_size
            if chain:
                self._add_chain(chain, domain)
                self._held[seq.seq_id] = chain

    def on_commit(self, seq: Sequence, start: int, end: int, block_ids: list[int]) -> None:
        """Nothing to record: the chain was added at admission."""

    def on_free(self, seq: Sequence, num_blocks: int) -> None:
        with self._lock:
            chain = self._held.pop(seq.seq_id, None)
            for digest in chain or ():
                node = self._nodes.get(digest)
                if node is not None and node.live > 0:
                    node.live -= 1

    # -- the map of recently seen blocks ---------------------------------------------------------

    def _reason(self, reads: bool, num_hit: int, chain: list[bytes], num_tokens: int) -> str:
        if not reads:
            return "cache-off"
        if num_hit >= (num_tokens - 1) // self.block_size or num_hit >= len(chain):
            return "full-hit"
        if chain[num_hit] in self._nodes:
            return "evicted-or-in-flight"  # computed before: evicted since, or computing now
        return "new-prefix" if num_hit == 0 else "diverged"

    def _add_chain(self, chain: list[bytes], domain: str) -> None:
        nodes = self._nodes
        parent: bytes | None = None
        for depth, digest in enumerate(chain, 1):
            node = nodes.get(digest)
            if node is None:
                node = nodes[digest] = _Node(parent, depth, domain)
                if parent is not None and parent in nodes:
                    nodes[parent].children.add(digest)
            else:
                nodes.move_to_end(digest)
            node.requests += 1
            node.live += 1
            parent = digest
        while len(nodes) > MAX_NODES:
            digest, node = nodes.popitem(last=False)
            if node.parent is not None and node.parent in nodes:
                nodes[node.parent].children.discard(digest)
            for child in node.children:
                if child in nodes:
                    nodes[child].parent = None

    def tree(self) -> list[JSONObject]:
        """The most requested shared prefixes as trees of segments: a run of blocks with one
        child each is one segment (``blocks`` long); a segment ends where requests part ways."""
        with self._lock:
            nodes = self._nodes
            roots = sorted((d for d, n in nodes.items()
                            if n.parent is None or n.parent not in nodes),
                           key=lambda d: -nodes[d].requests)
            shared = [d for d in roots if nodes[d].requests > 1]  # one-off prompts only if
            budget = [MAX_TREE_NODES]                             # nothing is shared
            return [self._segment(d, budget) for d in (shared or roots)[:MAX_TREE_ROOTS]
                    if nodes[d].requests > 0]

    def _segment(self, digest: bytes, budget: list[int]) -> JSONObject:
        nodes = self._nodes
        node = nodes[digest]
        first, blocks = node, 1
        while len(node.children) == 1:
            (child,) = node.children
            if child not in nodes or nodes[child].requests != node.requests:
                break
            digest, node = child, nodes[child]
            blocks += 1
        budget[0] -= 1
        children = sorted((c for c in node.children if c in nodes),
                          key=lambda c: -nodes[c].requests)
        out: JSONObject = {
            "digest": digest.hex()[:12], "start_block": first.depth - 1, "blocks": blocks,
            "requests": node.requests, "live": node.live, "domain": node.domain,
            "children": [],
        }
        for child in children:
            if budget[0] <= 0:
                out["more"] = len(children) - len(out["children"])
                break
            out["children"].append(self._segment(child, budget))
        return out

    def recent_admissions(self) -> list[JSONObject]:
        with self._lock:
            return [asdict(a) for a in reversed(self.recent)]

    def domain_tokens(self) -> dict[str, list[int]]:
        with self._lock:
            return {d: list(c) for d, c in self.domains.items()}


def dashboard_data(
    snap: EngineSnapshot, view: CacheView, metrics: ServerMetrics, model: str, block_size: int,
    tiers: JSONObject | None, pending: int,
) -> JSONObject:
    """The document ``GET /dashboard/data`` serves (one moment: ``snap``'s step)."""
    num_free = snap.num_free_blocks
    cached_free = snap.num_cached_free_blocks
    counters = metrics.counter_values()
    domains = []
    reasons = metrics.miss_reasons_by_domain()
    for label, (queried, hit) in sorted(view.domain_tokens().items()):
        p50, p99, n = metrics.ttft_quantiles(label)
        domains.append({"domain": label, "queried_tokens": queried, "hit_tokens": hit,
                        "hit_ratio": hit / queried if queried else 0.0,
                        "ttft_p50_s": p50, "ttft_p99_s": p99, "requests": n,
                        "miss_reasons": reasons.get(label, {})})
    return {
        "time": time.time(), "model": model, "step": snap.num_steps, "block_size": block_size,
        "pool": {"blocks": snap.num_blocks, "used": snap.num_blocks - num_free,
                 "cached_free": cached_free, "free": num_free - cached_free,
                 "pinned": snap.num_pinned_blocks, "cached": snap.num_cached_blocks,
                 "usage": snap.kv_cache_usage,
                 "min_free": snap.min_free_blocks},
        "requests": {"running": snap.num_running, "waiting": snap.num_waiting,
                     "queued_http": pending},
        "counters": {"prefix_cache_queries": snap.queried_tokens,
                     "prefix_cache_hits": snap.hit_tokens, "evictions": snap.evictions,
                     "preemptions": snap.preemptions, **counters},
        "domains": domains,
        "tree": view.tree(),
        "recent": view.recent_admissions(),
        "tiers": _tier_rows(tiers),
    }


def _tier_rows(stats: JSONObject | None) -> JSONObject:
    if stats is None:
        return {}
    keys = ("hits", "misses", "blocks_written", "bytes_written", "bytes_read", "evicted", "up",
            "quarantined", "write_errors", "blocks_held", "bytes_held", "capacity_bytes")
    return {name: {k: values.get(k) for k in keys} for name, values in stats["tiers"].items()}
