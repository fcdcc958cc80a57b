"""Ray Serve LLM's own prefix-aware router (``PrefixCacheAffinityRouter``) in front of our
replicas, for ``serve --router ray-prefix-aware``: its code, run as Ray ships it, on what our
ingress forwards.

Ray's router keys a character prefix tree by the prompt text it finds in the request (a
``prompt`` or ``messages`` attribute). Our router sees no prompt text, only the prompt's block
digests (`cluster.digests`), so the text it is given is those digests in hexadecimal, one run of
characters per block: a prompt's matched characters over its total are then its matched blocks
over its blocks (give or take the few leading hex digits a differing digest may share), and
its rules (the imbalance threshold, the 10% match-rate threshold, the
smallest replica below it, power of two choices otherwise) decide as on text. Requests with no
digest (a prompt shorter than a block, or none) go by power of two choices, which Ray's router
does when it finds no text; ``/metrics``' per-replica requests go to their replica.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from prefixcache.cluster import registry
from prefixcache.cluster.asgi import ForwardedRequest

__all__ = ["RayPrefixAwareRouter"]


class RayPrefixAwareRouter(PrefixCacheAffinityRouter):
    """``request_router_kwargs``: Ray's own (``imbalanced_threshold``, ``match_rate_threshold``,
    ``do_eviction``, ...); ``num_replicas`` is accepted and ignored."""

    def initialize_state(self, num_replicas: int = 0, **kwargs: Any) -> None:  # type: ignore[override]
        super().initialize_state(**kwargs)
        self.num_routed: dict[ReplicaID, int] = {}
        self.num_with_digests = 0
        registry.ROUTERS[self._deployment_id.name] = self  # this module is a by-value copy

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        forwarded = _forwarded_of(pending_request)
        if forwarded is None:
            return ""
        return "".join(digest.hex() for digest in forwarded.block_digests)

    async def choose_replicas(  # type: ignore[override]
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        forwarded = _forwarded_of(pending_request)
        if forwarded is not None and forwarded.pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == forwarded.pin]]
        if forwarded is None or not forwarded.block_digests:  # as Ray's router falls back
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self,  # type: ignore[arg-type]
                candidate_replicas=candidate_replicas,
                pending_request=pending_request,
            )
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        return ranks  # type: ignore[return-value]  # Ray's annotation says one rank

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self.num_routed[replica_id] = self.num_routed.get(replica_id, 0) + 1
        forwarded = _forwarded_of(pending_request)
        if forwarded is not None and forwarded.block_digests and forwarded.pin is None:
            self.num_with_digests += 1
            super().on_request_routed(pending_request, replica_id, result)

    def describe(self) -> dict[str, Any]:
        replicas = {
            r.replica_id.unique_id: {
                "slot": None,
                "in_flight": None,
                "mirror_blocks": None,
                "mirror_blocks_by_medium": None,
                "routed": self.num_routed.get(r.replica_id, 0),
                "routing_stats": dict(r.routing_stats or {}),
            }
            for r in self.curr_replicas.values()
        }
        return {
            "policy": "ray-prefix-aware",
            "routed_per_slot": [info["routed"] for info in replicas.values()],
            "routed_with_digests": self.num_with_digests,
            "routed_with_key": 0,
            "replicas": replicas,
            "event_replays": 0,
            "event_gaps_lost": 0,
        }


def _forwarded_of(pending: PendingRequest | None) -> ForwardedRequest | None:
    for arg in pending.args if pending is not None else ():
        if isinstance(arg, ForwardedRequest):
            return arg
    return None
