"""The request routers living in this process (the ingress), by deployment name.

Serve ships a custom router class to the handle's process by value (cloudpickle copies its
module's globals), so the registry the routers join lives here, in a module imported by
reference, where the ingress's /metrics and /cluster/routing find them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROUTERS", "router_stats"]

ROUTERS: dict[str, Any] = {}


def router_stats(deployment: str) -> dict[str, Any] | None:
    """The router's decisions and each replica's last routing stats; None before the first
    request made the handle build its router."""
    router = ROUTERS.get(deployment)
    return None if router is None else dict(router.describe())
