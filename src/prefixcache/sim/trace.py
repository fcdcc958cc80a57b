"""The trace model every reader and generator produces: requests as token counts and hash ids.

A request's prompt is ``input_length`` tokens; ``hash_ids[i]`` names the content of its block
``i`` (equal ids mean equal prefixes up to and including that block, as in the Mooncake format).
Only the first ``input_length // block_size`` ids describe complete blocks; an id for a partial
tail is kept as read but never makes that tail hittable.

A request may also name its ``tenant`` (an isolation domain: its blocks are namespaced apart from
other tenants' and its pins count against its own budget) and carry ``pins``: cache breakpoints,
each ``(num_tokens, ttl_s)``, the prefix through that token kept from eviction for ``ttl_s``
seconds of trace time, as Anthropic's ``cache_control`` does (`read_cache_fields` reads them
from a trace line). This module knows nothing about caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.pins import ttl_seconds
from prefixcache.sim.errors import TraceFormatError


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace. ``arrival_s`` is seconds from the trace start."""

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    group: str = ""  # conversation / session the request belongs to (informational)
    # a recorded trace's block digests, as the serving router saw them (see Router.choose_for)
    recorded_digests: list[bytes] = field(default_factory=list)
    tenant: str = ""  # isolation domain ("": the shared namespace)
    pins: list[tuple[int, float]] = field(default_factory=list)  # (num_tokens, ttl_s) breakpoints
    adapter: str = ""  # the LoRA adapter it runs under ("": the base model): its own namespace

    def __post_init__(self) -> None:
        if self.input_length < 1:
            raise ValueError(f"request {self.request_id}: input_length must be >= 1")
        if self.output_length < 0:
            raise ValueError(f"request {self.request_id}: output_length must be >= 0")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival time must be >= 0")

    def num_full_blocks(self, block_size: int) -> int:
        """Complete prompt blocks that carry a hash id (and so can be shared)."""
        return min(self.input_length // block_size, len(self.hash_ids))


@dataclass(slots=True)
class Trace:
    """Requests in arrival order (stable for equal times) at one block size."""

    name: str
    block_size: int
    requests: list[TraceRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"trace block_size must be >= 1, got {self.block_size}")

    def __len__(self) -> int:
        return len(self.requests)

    def sort_by_arrival(self) -> None:
        self.requests.sort(key=lambda r: r.arrival_s)

    @property
    def total_input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def has_cache_control(self) -> bool:
        """Some request carries a tenant or a pin (the report then splits hits by tenant)."""
        return any(r.tenant or r.pins for r in self.requests)

    @property
    def max_hash_id(self) -> int:
        return max((max(r.hash_ids) for r in self.requests if r.hash_ids), default=-1)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (a cheap slice for tests and quick looks)."""
        return Trace(self.name, self.block_size, self.requests[:n])

    def scale_arrivals(self, factor: float) -> None:
        """Compress (factor < 1) or stretch time, e.g. to replay a trace at a higher rate."""
        for request in self.requests:
            request.arrival_s *= factor


def read_adapter(obj: dict[str, Any], where: str) -> str:
    """A trace line's optional ``adapter``: the LoRA adapter it ran under (a name or an
    identity; "" or absent: the base model)."""
    adapter = obj.get("adapter", "")
    if not isinstance(adapter, str):
        raise TraceFormatError(f"{where}: 'adapter' must be a string")
    return adapter


def read_cache_fields(obj: dict[str, Any], where: str) -> tuple[str, list[tuple[int, float]]]:
    """A trace line's optional ``tenant`` (a string) and ``pins``: a list of ``{"tokens": N,
    "ttl": "5m" | "1h" | "24h" | seconds}`` (at most four, as Anthropic allows) or of
    ``[N, seconds]`` pairs, as a recorded trace writes them."""
    tenant = obj.get("tenant", "")
    if not isinstance(tenant, str):
        raise TraceFormatError(f"{where}: 'tenant' must be a string")
    raw = obj.get("pins", [])
    if not isinstance(raw, list) or len(raw) > 4:
        raise TraceFormatError(f"{where}: 'pins' must be a list of at most 4 breakpoints")
    pins = []
    for item in raw:
        tokens, ttl = (item.get("tokens"), item.get("ttl", "5m")) if isinstance(item, dict) else (
            item if isinstance(item, list) and len(item) == 2 else (None, None))
        seconds = ttl_seconds(ttl)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1 or not seconds:
            raise TraceFormatError(f"{where}: a pin is {{\"tokens\": N >= 1, \"ttl\": \"5m\", "
                                   f"\"1h\", \"24h\" or seconds up to a day}}, got {item!r}")
        pins.append((tokens, seconds))
    return tenant, pins
