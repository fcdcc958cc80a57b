"""Why did a request miss the cache? The vendors' diagnostics, answered per tenant.

A request that opts in (Anthropic: a ``diagnostics`` object; OpenAI Responses: any request, its
``prompt_cache_options.comparison_response_id`` asks for the comparison) leaves a `Fingerprint`
under its response id: the digests of its segments (model, system, tools, the other
prompt-affecting fields, each message) and of its prompt's full blocks in the cache's own chain,
and its token count — never text or token ids. A later request names that id; `Diagnoser.compare`
finds the first segment that changed, or, the new request extending the old one, checks what the
cache served against what it could have served. Beyond the vendors' reasons, the engine's own
(`ENGINE_REASONS`): ``evicted`` (with how long ago and by which pressure: the caller's own
requests, other tenants', a pin released for a waiting request, a purge or a reset),
``ttl_expired`` (its pin's TTL ran out, then it was evicted), ``tier_verify_failed`` (evicted,
and the lower tier's copy failed its checks), ``below_block`` (the shared part fits no whole
block) and ``cache_disabled_for_tenant``. What became of a block is asked of the cache's fates
(`prefixcache.cache.fates`) under the caller's own digests and domain only.

Fingerprints are kept per tenant (``scope``) in a bounded store with a TTL: another tenant's id is
looked up in the caller's own scope, where it is exactly as absent as an id never issued.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prefixcache.server.diagnostics_store import FingerprintStore, store_key

if TYPE_CHECKING:
    from prefixcache.cache.fates import Fate

__all__ = [
    "ENGINE_REASONS", "NOT_FOUND", "Diagnoser", "Diagnosis", "Fingerprint", "Outcome", "Verdict",
    "segment_digest",
]  # fmt: skip

DEFAULT_MAX_ENTRIES = 8192
DEFAULT_TTL_S = 3600.0
_BLOCK_DIGEST_BYTES = 8  # of each block's chained digest: enough to find the common prefix


def segment_digest(value: object) -> bytes:
    """The digest of one request segment (its canonical JSON): what is compared, not kept."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return hashlib.sha256(text.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """One request, as diagnostics see it. ``segments``: (name, digest) in the order a change
    is reported (model first); ``messages``: one digest per message; ``blocks``: the prompt's
    full blocks (truncated chained digests, salt and model included); ``num_tokens``: its
    prompt's length."""

    segments: tuple[tuple[str, bytes], ...]
    messages: tuple[bytes, ...]
    blocks: tuple[bytes, ...]
    num_tokens: int

    @classmethod
    def of(cls, segments: Sequence[tuple[str, object]], messages: Sequence[object],
           block_digests: Sequence[bytes], num_tokens: int) -> Fingerprint:  # fmt: skip
        return cls(tuple((name, segment_digest(v)) for name, v in segments),
                   tuple(segment_digest(m) for m in messages),
                   tuple(d[:_BLOCK_DIGEST_BYTES] for d in block_digests), num_tokens)

    def to_bytes(self, made_at_wall: float) -> bytes:
        """The fingerprint (made at ``made_at_wall``, `time.time`) as stored: hex digests."""
        return json.dumps({"t": made_at_wall, "n": self.num_tokens,
                           "s": [[name, d.hex()] for name, d in self.segments],
                           "m": [d.hex() for d in self.messages],
                           "b": [d.hex() for d in self.blocks]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple[float, Fingerprint] | None:
        """(made at, the fingerprint) of `to_bytes`' output; None for anything else."""
        try:
            v = json.loads(data)
            return float(v["t"]), cls(
                tuple((str(name), bytes.fromhex(d)) for name, d in v["s"]),
                tuple(bytes.fromhex(d) for d in v["m"]),
                tuple(bytes.fromhex(d) for d in v["b"]), int(v["n"]))
        except (ValueError, KeyError, TypeError):
            return None


ENGINE_REASONS = ("evicted", "ttl_expired", "below_block", "tier_verify_failed",
                  "cache_disabled_for_tenant")  # beyond the vendors' segment reasons
FateOf = Callable[[bytes, float], "Fate | None"]  # (block digest, since): why it left


@dataclass(frozen=True, slots=True)
class Verdict:
    """The comparison of a request with an earlier one. ``reason``: the first segment that
    changed (a segment's name, or ``messages``), one of `ENGINE_REASONS` (nothing changed, the
    cache served less than the earlier request left), or None (nothing changed, the cache served
    it). ``missed_tokens``: of the earlier request's reusable tokens, those this one could not
    reuse; ``reusable_tokens``: the earlier request's (its full blocks); ``detail``: how long
    ago and by which pressure the prefix left (``evicted``, ``ttl_expired``,
    ``tier_verify_failed``), numbers and names only. ``public``: where the prompt starts with
    a declared public prefix, its tokens in public blocks and how many of them the cache
    served (`public_part`)."""

    reason: str | None
    missed_tokens: int
    reusable_tokens: int
    detail: Mapping[str, float | str] | None = None
    public: Mapping[str, int] | None = None

    def public_part(self) -> dict[str, int]:
        """``public_tokens`` and ``public_cached_tokens`` (nothing without a public prefix)."""
        return dict(self.public or {})


class Diagnoser:
    """The fingerprints of recent requests, per scope, at most ``max_entries`` (the oldest go
    first) and each for ``ttl_s`` seconds; thread safe. ``now`` stamps each with the fates'
    clock (`prefixcache.cache.fates`), to ask what became of its blocks since. With a
    ``store`` (`prefixcache.server.diagnostics_store`) each is also written there, written
    behind on a thread of its own, and read back when memory does not hold it (another
    replica's, or the process restarted)."""

    def __init__(self, block_size: int, max_entries: int = DEFAULT_MAX_ENTRIES,
                 ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], float] = time.monotonic,
                 store: FingerprintStore | None = None) -> None:  # fmt: skip
        self.block_size = block_size
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self.now = now
        self.store = store
        self._writer = ThreadPoolExecutor(1, "diagnostics-store") if store is not None else None
        self._entries: OrderedDict[tuple[str, str], tuple[float, float, Fingerprint]] = (
            OrderedDict())
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, scope: str, response_id: str, fingerprint: Fingerprint) -> None:
        with self._lock:
            self._keep(scope, response_id, self.now(), fingerprint)
        if self.store is not None and self._writer is not None:
            self._writer.submit(self.store.put, store_key(scope, response_id),
                                fingerprint.to_bytes(time.time()), self.ttl_s)

    def _keep(self, scope: str, response_id: str, made_at: float, fingerprint: Fingerprint,
              ) -> None:  # fmt: skip
        self._entries[(scope, response_id)] = (self.clock() + self.ttl_s, made_at, fingerprint)
        self._entries.move_to_end((scope, response_id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def find(self, scope: str, response_id: str) -> tuple[float, Fingerprint] | None:
        """The fingerprint ``scope`` left under ``response_id``, with when (``now``'s clock);
        None: never, expired, evicted from the store, or another scope's."""
        with self._lock:
            entry = self._entries.get((scope, response_id))
            if entry is not None:
                expires_at, made_at, fingerprint = entry
                if expires_at > self.clock():
                    return made_at, fingerprint
                del self._entries[(scope, response_id)]
        return self._stored(scope, response_id)

    def _stored(self, scope: str, response_id: str) -> tuple[float, Fingerprint] | None:
        """The fingerprint from the store (another replica's, or before a restart)."""
        data = self.store.get(store_key(scope, response_id)) if self.store is not None else None
        found = Fingerprint.from_bytes(data) if data is not None else None
        if found is None:
            return None
        made_wall, fingerprint = found
        made_at = self.now() - max(0.0, time.time() - made_wall)  # on the fates' clock
        with self._lock:
            self._keep(scope, response_id, made_at, fingerprint)
        return made_at, fingerprint

    def close(self) -> None:
        """Finish the store's pending writes."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def compare(self, earlier: Fingerprint, now: Fingerprint, num_cached: int,
                fate_of: FateOf | None = None, since: float = 0.0) -> Verdict:  # fmt: skip
        """``now`` (which the cache served ``num_cached`` tokens of) against ``earlier`` (left
        at ``since``); ``fate_of`` tells what became of a block that the cache no longer had."""
        bs = self.block_size
        common = 0
        for a, b in zip(earlier.blocks, now.blocks, strict=False):
            if a != b:
                break
            common += 1
        reusable = len(earlier.blocks) * bs
        missed = max(0, reusable - common * bs)
        before = dict(earlier.segments)
        for name, digest in now.segments:
            if before.get(name) != digest:
                return Verdict(name, missed, reusable)
        if earlier.messages != now.messages[: len(earlier.messages)]:
            return Verdict("messages", missed, reusable)
        # an extension of the earlier request: what it left, up to this prompt's last block
        could = min(common, max(0, (now.num_tokens - 1) // bs)) * bs
        if num_cached < could:
            return self._lost(now, num_cached, could, reusable, fate_of, since)
        if not could and not num_cached and earlier.num_tokens:  # the shared part fits no block
            return Verdict("below_block", min(earlier.num_tokens, now.num_tokens), reusable)
        return Verdict(None, 0, reusable)

    def _lost(self, now: Fingerprint, num_cached: int, could: int, reusable: int,
              fate_of: FateOf | None, since: float) -> Verdict:  # fmt: skip
        """The cache served ``num_cached`` of the ``could`` tokens the earlier request left:
        why its first block missing left the cache, where that is known."""
        missed = could - num_cached
        fate = fate_of(now.blocks[num_cached // self.block_size], since) if fate_of else None
        if fate is None:
            return Verdict("evicted", missed, reusable)
        detail: dict[str, float | str] = {
            "evicted_seconds_ago": round(max(0.0, self.now() - fate.at), 3),
            "pressure": fate.pressure}
        if fate.tier_failed:
            return Verdict("tier_verify_failed", missed, reusable, detail)
        if fate.pin_expired_at is not None:
            detail["ttl_expired_seconds_ago"] = round(max(0.0, self.now() - fate.pin_expired_at), 3)
            return Verdict("ttl_expired", missed, reusable, detail)
        return Verdict("evicted", missed, reusable, detail)


NOT_FOUND = "not_found"  # the earlier id names no fingerprint of this scope
Outcome = Verdict | str | None  # a verdict, NOT_FOUND, or None: nothing to compare with


def reason_label(outcome: Verdict | str) -> str:
    """An outcome as metrics count it: ``none`` (no miss), ``not_found``, an engine reason, or
    ``<segment>_changed`` (``messages_changed``: the prompt's messages or input)."""
    if isinstance(outcome, str):
        return outcome
    reason = outcome.reason
    if reason is None:
        return "none"
    return reason if reason in ENGINE_REASONS else f"{reason}_changed"


class Diagnosis:
    """One request's diagnostics: its ``fingerprint``, compared with the one ``earlier_id``
    left (None: nothing to compare, the request only opts in) once its prefill is done, and
    left under its own id for the next request. ``on_reason`` counts each reason given;
    ``fate_of`` (the caller's own blocks only) says why a block left the cache; ``use_cache``:
    False where the caller's tenant shares no cache (every comparison then says so)."""

    def __init__(self, diagnoser: Diagnoser, scope: str, fingerprint: Fingerprint,
                 earlier_id: str | None,
                 on_reason: Callable[[str], None] = lambda reason: None,
                 fate_of: FateOf | None = None, use_cache: bool = True,
                 public_tokens: int = 0) -> None:  # fmt: skip
        self.public_tokens = public_tokens  # the prompt's tokens in public blocks
        self.diagnoser = diagnoser
        self.scope = scope
        self.fingerprint = fingerprint
        self.earlier_id = earlier_id
        self.on_reason = on_reason
        self.fate_of = fate_of
        self.use_cache = use_cache
        self._outcome: Outcome = None
        self._done = False

    def outcome(self, response_id: str, num_cached: int) -> Outcome:
        """The comparison (made once) for this request, served ``num_cached`` tokens from the
        cache and answered as ``response_id``."""
        if self._done:
            return self._outcome
        self._done = True
        diagnoser = self.diagnoser
        if self.earlier_id is not None:
            outcome = self._outcome = self._compare(self.earlier_id, num_cached)
            self.on_reason(reason_label(outcome))
        diagnoser.remember(self.scope, response_id, self.fingerprint)
        return self._outcome

    def _compare(self, earlier_id: str, num_cached: int) -> Verdict | str:
        found = self.diagnoser.find(self.scope, earlier_id)
        if found is None:
            return NOT_FOUND
        since, earlier = found
        if not self.use_cache:
            return Verdict("cache_disabled_for_tenant",
                           min(earlier.num_tokens, self.fingerprint.num_tokens), 0)
        verdict = self.diagnoser.compare(earlier, self.fingerprint, num_cached, self.fate_of,
                                         since)
        if not self.public_tokens:
            return verdict
        public = {"public_tokens": self.public_tokens,
                  "public_cached_tokens": min(num_cached, self.public_tokens)}
        return replace(verdict, public=public)
