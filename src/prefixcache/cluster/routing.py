"""The simulator's routers as Ray Serve request routers (``request_router_config``).

Ray Serve asks a deployment handle's router to rank replicas for each pending request
(`ray.serve.request_router.RequestRouter.choose_replicas`). `PrefixCacheRouter` answers with the
simulator's own rules (`prefixcache.sim.router`: ``round-robin``, ``prefix-affinity``,
``cache-aware``), so the names, thresholds and tie-breaks are the ones `prefixcache simulate
--replicas N --router ...` evaluates. A rule works on replica slots ``0 .. N-1``: each live Serve
replica holds one slot; a restarted replica takes the slot its predecessor left, with an empty
mirror.

What the router sees: the request's block digests (computed by the ingress, never prompt text),
its affinity key (``prompt_cache_key``, keyed by the tenant's namespace),
its own count of requests in flight per replica (routed minus completed), and, for
``cache-aware``, the replicas' KV events, subscribed to on the ZMQ endpoints each replica reports
in its routing stats (`cluster.feed.EventFeed`). A replica that dies is forgotten at once
(``on_replica_actor_died``), and its events are no longer read.

The first rank is the rule's choice; the second holds the other replicas by load, which Serve
tries when the first is at its ``max_ongoing_requests``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixcache.cluster import registry
from prefixcache.cluster.asgi import ForwardedRequest
from prefixcache.sim.replica_costs import ReplicaCosts
from prefixcache.sim.router import Router, make_router

__all__ = ["PrefixCacheRouter"]

logger = logging.getLogger("prefixcache.cluster")

_BUSY = 1 << 30  # the load of a slot with no live replica: never the least loaded

class PrefixCacheRouter(RequestRouter):
    """``request_router_kwargs``: ``policy`` (a `prefixcache.sim.router` name), ``num_replicas``,
    ``affinity_blocks`` (prefix-affinity's K)."""

    def initialize_state(self, policy: str = "cache-aware", num_replicas: int = 1,
                         affinity_blocks: int = 4, **kwargs: Any) -> None:
        self.policy = policy
        self.rule: Router = make_router(policy, num_replicas)
        if hasattr(self.rule, "k"):
            self.rule.k = affinity_blocks
        self._lock = threading.Lock()  # the event feed's thread updates the mirrors
        self._slot_of: dict[ReplicaID, int] = {}
        self._in_flight: dict[ReplicaID, int] = {}
        self._feed_of: dict[ReplicaID, str] = {}  # replica -> its event endpoint being read
        self.num_routed = [0] * num_replicas
        self.num_with_digests = 0
        self.num_with_key = 0  # routed with a prompt_cache_key
        self._feed: Any = None
        if self.rule.wants_events:
            from prefixcache.cluster.feed import EventFeed

            self._feed = EventFeed(self._on_events, self._on_lost)
        registry.ROUTERS[self._deployment_id.name] = self  # this module is a by-value copy
        logger.info("routing %s by %s over %d replica slots", self._deployment_id.name, policy,
                    num_replicas)

    # ---- replicas come and go ------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._slot_of if rid not in live]:
            self._release(gone)
        for replica in replicas:
            if replica.replica_id not in self._slot_of:
                self._assign(replica.replica_id)
            self._watch(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._release(replica_id)

    def _assign(self, replica_id: ReplicaID) -> None:
        taken = set(self._slot_of.values())
        free = [s for s in range(self.rule.num_replicas) if s not in taken]
        if not free:
            logger.warning("more live replicas than --replicas; %s is routed by load only",
                           replica_id.unique_id)
            return
        with self._lock:
            self._slot_of[replica_id] = free[0]
            self._clear_mirror(free[0])

    def _release(self, replica_id: ReplicaID) -> None:
        with self._lock:  # the feed's thread reads _slot_of and _feed_of
            slot = self._slot_of.pop(replica_id, None)
            if slot is not None:
                self._clear_mirror(slot)
            topic = self._feed_of.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)
        if topic is not None and self._feed is not None:
            self._feed.forget(topic)

    def _clear_mirror(self, slot: int) -> None:
        self.rule.forget(slot)

    def _watch(self, replica: RunningReplica) -> None:
        """Read the replica's KV events once it has reported where it publishes them."""
        if self._feed is None or replica.replica_id in self._feed_of:
            return
        stats = replica.routing_stats or {}
        endpoint = stats.get("kv_events_endpoint")
        if not endpoint:
            return
        topic = stats.get("kv_events_topic") or replica.replica_id.unique_id
        with self._lock:
            self._feed_of[replica.replica_id] = topic
        self._feed.watch(topic, endpoint, stats.get("kv_events_replay_endpoint"))

    # ---- events --------------------------------------------------------------------------------

    def _slot_of_topic(self, topic: str) -> int | None:
        for replica_id, watched in self._feed_of.items():
            if watched == topic:
                return self._slot_of.get(replica_id)
        return None

    def _on_events(self, topic: str, events: list[Any]) -> None:
        with self._lock:
            slot = self._slot_of_topic(topic)
            if slot is not None:
                self.rule.observe(slot, events)

    def _on_lost(self, topic: str) -> None:
        with self._lock:
            slot = self._slot_of_topic(topic)
            if slot is not None:
                self._clear_mirror(slot)

    # ---- routing -------------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        for replica in candidate_replicas:  # routing stats arrive after a replica starts
            self._watch(replica)
        pinned = _forwarded_of(pending_request)
        if pinned is not None and pinned.pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned.pin]]
        digests = pinned.block_digests if pinned is not None else []
        key = pinned.affinity_key if pinned is not None else None
        by_slot = {self._slot_of[r.replica_id]: r for r in candidate_replicas
                   if r.replica_id in self._slot_of}
        loads = [self._in_flight.get(by_slot[s].replica_id, 0) if s in by_slot else _BUSY
                 for s in range(self.rule.num_replicas)]
        if not by_slot:
            return [candidate_replicas]
        with self._lock:
            for index, replica in by_slot.items():  # what each measured its loads to cost
                costs = (replica.routing_stats or {}).get("kv_costs")
                if isinstance(costs, dict):
                    self.rule.set_costs(index, ReplicaCosts.from_dict(costs))
            slot = self.rule.choose(digests, loads, key)
        first = by_slot.get(slot)
        if first is None:  # the rule's replica is not live: the least loaded one is
            first = min(by_slot.values(), key=lambda r: self._in_flight.get(r.replica_id, 0))
        rest = sorted((r for r in candidate_replicas if r is not first),
                      key=lambda r: self._in_flight.get(r.replica_id, 0))
        return [[first], rest] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        slot = self._slot_of.get(replica_id)
        if slot is not None:
            self.num_routed[slot] += 1
        forwarded = _forwarded_of(pending_request)
        if forwarded is not None and forwarded.block_digests:
            self.num_with_digests += 1
        if forwarded is not None and forwarded.affinity_key is not None:
            self.num_with_key += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1

    def describe(self) -> dict[str, Any]:
        mirrors = getattr(self.rule, "mirrors", None)
        held_blocks = getattr(self.rule, "held_blocks", None)

        def believed(slot: int | None) -> int | None:
            """Blocks the router believes the replica in ``slot`` holds in its KV pool."""
            return None if mirrors is None or slot is None else len(mirrors[slot])

        def believed_by_medium(slot: int | None) -> dict[str, int] | None:
            """The same per medium: the pool (``POOL``), its tiers and the shared ones."""
            return None if held_blocks is None or slot is None else held_blocks(slot)

        replicas = {}
        for r in self.curr_replicas.values():
            slot = self._slot_of.get(r.replica_id)
            replicas[r.replica_id.unique_id] = {
                "slot": slot, "in_flight": self._in_flight.get(r.replica_id, 0),
                "mirror_blocks": believed(slot),
                "mirror_blocks_by_medium": believed_by_medium(slot),
                "routing_stats": dict(r.routing_stats or {})}
        return {"policy": self.policy, "routed_per_slot": list(self.num_routed),
                "routed_with_digests": self.num_with_digests,
                "routed_with_key": self.num_with_key, "replicas": replicas,
                "event_replays": getattr(self._feed, "num_replays", 0),
                "event_gaps_lost": getattr(self._feed, "num_lost", 0)}


def _forwarded_of(pending: PendingRequest | None) -> ForwardedRequest | None:
    for arg in pending.args if pending is not None else ():
        if isinstance(arg, ForwardedRequest):
            return arg
    return None
