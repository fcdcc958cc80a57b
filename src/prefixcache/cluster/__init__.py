"""Scale-out on Ray Serve: engine replicas behind an ingress whose request router routes by the
prompt's block digests (`prefixcache serve --replicas N`; docs/cluster.md).

``cluster.asgi``, ``cluster.digests``, ``cluster.feed``, ``cluster.metrics`` and
``cluster.launch`` import no Ray at module level; ``cluster.routing`` and
``cluster.deployments`` need ``prefixcache[cluster]``.
"""
