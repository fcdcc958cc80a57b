"""The cluster as two Ray Serve deployments: `EngineReplica` (N of them) behind one `Ingress`.

``EngineReplica`` is a whole `prefixcache serve` process in a Serve replica: its own engine,
cache, tenancy and metrics, and the same FastAPI app, which it runs in-process for each
`ForwardedRequest` (`cluster.asgi`). With the cache-aware router it publishes its KV events on a
free port of its node and reports the endpoint in its routing stats.

``Ingress`` answers every HTTP path on Serve's proxy. For the prompt endpoints it computes the
prompt's block digests (`cluster.digests`) and calls the replicas' handle, whose request router
(`cluster.routing.PrefixCacheRouter`) picks the replica from the digests. A request that fails
because its replica died before answering is sent again (to another replica, the dead one being
gone from the router); once a response has started, a failure ends it. ``/metrics`` gathers every
replica's page (`cluster.metrics`), ``/cluster/routing`` shows the router's decisions. A LoRA
adapter's load or unload goes to every replica, and the prompt digests of the requests after it
name its blocks as the replicas do (an adapter given at start or loaded later alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from prefixcache.cluster.asgi import ForwardedRequest, ResponseHead, run_asgi
from prefixcache.server.errors import stream_error_event

__all__ = ["EngineReplica", "Ingress"]

logger = logging.getLogger("prefixcache.cluster")

_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}
_PROMPT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
_EVERY_REPLICA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class EngineReplica:
    """One engine and its OpenAI app (``args``: parsed ``prefixcache serve`` flags)."""

    def __init__(self, args: argparse.Namespace, secret: bytes, threads: int,
                 publish_events: bool) -> None:
        import torch

        from prefixcache.server.cli import build_app

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.set_num_threads(threads)
        self.topic = serve.get_replica_context().replica_id.unique_id
        if publish_events:
            args = _with_event_endpoint(args, self.topic)
        if args.record_trace:  # one part per replica, merged by the launcher at exit
            args = argparse.Namespace(**vars(args))
            args.record_trace = f"{args.record_trace}.{self.topic}.part"
        self.app = build_app(args, secret)
        self.async_engine = self.app.state.async_engine
        self.async_engine.start()
        self.identity = self.async_engine.cache_identity.as_dict()
        publisher = getattr(self.app.state, "kv_event_publisher", None)
        self.events = None if publisher is None else {
            "kv_events_endpoint": publisher.endpoint,
            "kv_events_replay_endpoint": publisher.replay_endpoint,
            "kv_events_topic": self.topic,
        }

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        async for item in run_asgi(self.app, request):
            yield item

    def describe(self) -> dict[str, Any]:
        """Its cache identity, and its LoRA adapters' (name -> identity) for the ingress."""
        loras = self.async_engine.loras
        adapters = {} if loras is None else {
            r.lora_name: loras.identity_of(r.lora_name) for r in loras.requests()}
        return {**self.identity, "replica": self.topic, "adapters": adapters}

    def record_routing_stats(self) -> dict[str, Any]:
        from prefixcache.cluster.costs import replica_costs

        costs = replica_costs(self.async_engine.snapshot, self.app.state.tier_stats(),
                              self.async_engine.limits.block_size)
        return {**(self.events or {}), "num_pending": self.async_engine.num_pending,
                "kv_costs": costs.as_dict(),  # what its prefill and tier loads cost
                "pid": os.getpid()}  # the process to look at (or kill, in a fault drill)

    def check_health(self) -> None:
        if not self.async_engine.is_alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.stop()


def _with_event_endpoint(args: argparse.Namespace, topic: str) -> argparse.Namespace:
    """``args`` publishing KV events on free ports of this node, under this replica's topic."""
    import ray

    host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    config = json.loads(args.kv_events_config) if args.kv_events_config else {}
    config.update(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://{host}:*",
                  replay_endpoint=f"tcp://{host}:*", topic=topic)
    out = argparse.Namespace(**vars(args))
    out.kv_events_config = json.dumps(config)
    if out.kv_events_token_ids == "auto":  # the router reads digests only
        out.kv_events_token_ids = "off"
    return out


class Ingress:
    """The HTTP front: digests for the router, forwarding with retry, merged /metrics."""

    def __init__(self, args: argparse.Namespace, secret: bytes, replicas: Any,
                 num_replicas: int) -> None:
        from prefixcache.model.loader import open_checkpoint
        from prefixcache.server.cli import declare_public_prefixes, tenant_registry

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.replicas = replicas
        self.max_attempts = num_replicas + 1  # each live replica once, and one more
        self.max_request_bytes = args.max_request_bytes
        checkpoint = open_checkpoint(args.model)
        self.tokenizer = checkpoint.tokenizer()
        self.tenants = tenant_registry(args, secret)
        declare_public_prefixes(args, self.tenants, self.tokenizer, checkpoint.config.vocab_size)
        from prefixcache.server.app import metrics_authorization

        self._metrics_auth = metrics_authorization(self.tenants, args.metrics_key)
        self.literal_content = not args.trust_special_tokens_in_content
        self._digester: Any = None
        self.num_retries = 0  # requests sent again after their replica died before answering

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics":
            return await self._metrics(request)
        if path == "/cluster/routing":
            return self._routing(request)
        if path == "/dashboard/data" and request.method == "GET":
            return await self._dashboard(request)
        body = await request.body()
        if len(body) > self.max_request_bytes:
            return _error(413, f"the request body is larger than {self.max_request_bytes} bytes")
        if request.method == "POST" and path in _EVERY_REPLICA_PATHS:
            return await self._to_every_replica(request, body)
        forwarded = _forwarded(request, body)
        if request.method == "POST" and path in _PROMPT_PATHS:
            route = await self._route(request, path, body)
            forwarded.block_digests = route.block_digests
            forwarded.affinity_key = route.affinity_key
        return await self._forward(forwarded)

    def _routing(self, request: Request) -> Response:
        """The router's state; with tenants, for an admin or the metrics key (as /metrics)."""
        from prefixcache.cluster.registry import router_stats
        from prefixcache.server.errors import ApiError

        try:
            self._metrics_auth(request)
        except ApiError as exc:
            return exc.response()
        stats = router_stats("EngineReplica") or {"policy": None}
        return JSONResponse({**stats, "retries": self.num_retries})

    async def _route(self, request: Request, path: str, body: bytes) -> Any:
        from prefixcache.server.app import api_key_of

        digester = await self._get_digester()
        return await asyncio.to_thread(digester.route, path, api_key_of(request), body)

    async def _get_digester(self) -> Any:
        if self._digester is None:
            from prefixcache.cache import CacheIdentity
            from prefixcache.cluster.digests import PromptDigester

            info = await self.replicas.describe.remote()
            identity = CacheIdentity.from_dict(info)
            self._digester = PromptDigester(self.tokenizer, self.tenants, identity,
                                            self.literal_content, info.get("adapters"))
        return self._digester

    async def _to_every_replica(self, request: Request, body: bytes) -> Response:
        """A LoRA adapter loaded or unloaded on every replica, so that any of them serves it
        and the router names its requests' blocks in its namespace (the digester asks the
        replicas' adapters again): the first refusal's answer, else the first replica's."""
        from prefixcache.cluster.registry import router_stats

        if router_stats("EngineReplica") is None:  # no request yet: no router either
            await self.replicas.describe.remote()
        answers = []
        for replica in sorted((router_stats("EngineReplica") or {"replicas": {}})["replicas"]):
            forwarded = _forwarded(request, body)
            forwarded.pin = replica
            status, text = await self._collect(forwarded)
            if text:  # else it died since the router listed it
                answers.append((status, text))
        self._digester = None
        if not answers:
            return _error(503, "no replica answered", code="replica_unavailable")
        status, text = next((a for a in answers if a[0] >= 300), answers[0])
        return Response(text, status_code=status,
                        media_type="text/plain" if status < 300 else "application/json")

    async def _forward(self, forwarded: ForwardedRequest) -> Response:
        last: Exception | None = None
        for attempt in range(self.max_attempts):
            stream = self.replicas.options(stream=True).handle.remote(forwarded)
            try:
                head = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as exc:
                last = exc
                self.num_retries += 1
                logger.warning("a replica failed before answering (attempt %d of %d): %s",
                               attempt + 1, self.max_attempts, type(exc).__name__)
                continue
            except StopAsyncIteration:
                return _error(502, "the replica closed the response without answering")
            assert isinstance(head, ResponseHead)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers
                       if k.lower() not in _HOP_HEADERS}
            return StreamingResponse(_body(stream, forwarded.path, headers),
                                     status_code=head.status, headers=headers)
        return _error(503, f"no replica could answer ({type(last).__name__}); retry later",
                      code="replica_unavailable")

    async def _metrics(self, request: Request) -> Response:
        from prefixcache.cluster.metrics import merge_replica_metrics
        from prefixcache.cluster.registry import router_stats
        from prefixcache.server.errors import ApiError

        try:
            self._metrics_auth(request)  # the replicas check again on their own pages
        except ApiError as exc:
            return exc.response()
        stats = router_stats("EngineReplica")
        if stats is None:  # no request yet: the handle's router does not exist before one
            await self.replicas.describe.remote()
            stats = router_stats("EngineReplica") or {"replicas": {}}
        pages: dict[str, str] = {}
        for replica in stats["replicas"]:
            forwarded = _forwarded(request, b"")
            forwarded.pin = replica
            status, text = await self._collect(forwarded)
            if status != 200:
                return Response(text, status_code=status, media_type="application/json")
            pages[replica] = text
        from prefixcache.cluster.metrics import router_belief
        from prefixcache.server.metrics import CONTENT_TYPE

        return Response(merge_replica_metrics(pages) + router_belief(stats["replicas"]),
                        media_type=CONTENT_TYPE)

    async def _dashboard(self, request: Request) -> Response:
        """The first replica's dashboard document, with ``cluster``: per replica the router's
        belief (the blocks its event mirror holds) beside the replica's own cached blocks, and
        the same per medium (pool and tiers) with the drift between them. Each replica checks
        the caller's key or session itself."""
        from prefixcache.cluster.registry import router_stats

        stats = router_stats("EngineReplica")
        if stats is None:
            await self.replicas.describe.remote()
            stats = router_stats("EngineReplica") or {"replicas": {}}
        docs: dict[str, Any] = {}
        for replica in sorted(stats["replicas"]):
            forwarded = _forwarded(request, b"")
            forwarded.pin = replica
            status, text = await self._collect(forwarded)
            if status != 200:
                return Response(text, status_code=status, media_type="application/json")
            if text:
                docs[replica] = json.loads(text)
        if not docs:
            return _error(503, "no replica answered", code="replica_unavailable")
        body = dict(next(iter(docs.values())))
        from prefixcache.cluster.metrics import belief_beside_truth

        rows = []
        for replica, info in sorted(stats["replicas"].items()):
            doc = docs.get(replica)
            counters = doc["counters"] if doc else {}
            queries = counters.get("prefix_cache_queries", 0)
            rows.append({
                "replica": replica, "slot": info.get("slot"), "in_flight": info.get("in_flight"),
                "router_believes": info.get("mirror_blocks"),
                "replica_holds": doc["pool"]["cached"] if doc else None,
                "by_medium": belief_beside_truth(info.get("mirror_blocks_by_medium"), doc),
                "hit_ratio": counters.get("prefix_cache_hits", 0) / queries if queries else None,
                "running": doc["requests"]["running"] if doc else None,
            })
        body["cluster"] = {"policy": stats.get("policy"), "replicas": rows,
                           "retries": self.num_retries}
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    async def _collect(self, forwarded: ForwardedRequest) -> tuple[int, str]:
        status, chunks = 502, []
        try:
            async for item in self.replicas.options(stream=True).handle.remote(forwarded):
                if isinstance(item, ResponseHead):
                    status = item.status
                else:
                    chunks.append(item)
        except (RayActorError, ActorUnavailableError):
            return 200, ""  # died since the router listed it: no page from it this time
        return status, b"".join(chunks).decode()


async def _body(stream: Any, path: str, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The replica's response, chunk by chunk. A replica that dies mid-stream ends an event
    stream with an error event in the route's shape (the clients raise it); any other body
    just ends, short, which its client reports as an incomplete read."""
    try:
        async for chunk in stream:
            yield chunk
    except (RayActorError, ActorUnavailableError) as exc:
        logger.warning("a replica failed mid-response (%s): the response ends here",
                       type(exc).__name__)
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        if content_type.startswith("text/event-stream"):
            message = "the replica serving this stream failed; the answer is incomplete"
            yield stream_error_event(path, 502, message).encode()
    finally:
        stream.cancel()  # a client that went away aborts the replica's request


def _forwarded(request: Request, body: bytes) -> ForwardedRequest:
    return ForwardedRequest(request.method, request.url.path, request.url.query.encode(),
                            list(request.headers.raw), body)


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error",
                                   "param": None, "code": code}}, status_code=status)


def replica_options(args: argparse.Namespace, num_replicas: int) -> dict[str, Any]:
    """Serve options of the engine deployment for the parsed flags."""
    return {
        "num_replicas": num_replicas,
        "ray_actor_options": {"num_cpus": args.cpus_per_replica,
                              "runtime_env": {"env_vars": {
                                  "OMP_NUM_THREADS": str(args.threads_per_replica)}}},
        "max_ongoing_requests": args.max_num_seqs + args.max_queue_len,
        "health_check_period_s": 2.0,
        "request_router_config": {**_router_class(args, num_replicas),
                                  "request_routing_stats_period_s": 0.5},
    }


def _router_class(args: argparse.Namespace, num_replicas: int) -> dict[str, Any]:
    """Our router over the simulator's rule ``--router``, or Ray Serve LLM's own."""
    if args.router == "ray-prefix-aware":
        return {"request_router_class": "prefixcache.cluster.ray_prefix.RayPrefixAwareRouter",
                "request_router_kwargs": {"num_replicas": num_replicas}}
    return {"request_router_class": "prefixcache.cluster.routing.PrefixCacheRouter",
            "request_router_kwargs": {"policy": args.router, "num_replicas": num_replicas,
                                      "affinity_blocks": args.affinity_blocks}}


def build(args: argparse.Namespace, secret: bytes) -> Any:
    """The Serve application for parsed ``serve --replicas N`` flags."""
    n = args.replicas
    engine = serve.deployment(name="EngineReplica", **replica_options(args, n))(EngineReplica)
    from prefixcache.sim.router import ROUTERS

    reads_events = ROUTERS[args.router](n).wants_events  # the cache-aware rules
    replicas = engine.bind(args, secret, args.threads_per_replica, reads_events)
    ingress = serve.deployment(name="Ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0})(Ingress)
    return ingress.bind(args, secret, replicas, n)
