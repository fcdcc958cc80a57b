"""Why did a request miss the cache? The vendors' diagnostics, answered per tenant.

A request that opts in (Anthropic: a ``diagnostics`` object; OpenAI Responses: any request, its
``prompt_cache_options.comparison_response_id`` asks for the comparison) leaves a `Fingerprint`
under its response id: the digests of its segments (model, system, tools, the other
prompt-affecting fields, each message) and of its prompt's full blocks in the cache's own chain,
and its token count — never text or token ids. A later request names that id; `Diagnoser.compare`
finds the first segment that changed, or, the new request extending the old one, checks what the
cache served against what it could have served (``evicted``: our reason beyond the vendors').

Fingerprints are kept per tenant (``scope``) in a bounded store with a TTL: another tenant's id is
looked up in the caller's own scope, where it is exactly as absent as an id never issued.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "NOT_FOUND", "Diagnoser", "Diagnosis", "Fingerprint", "Outcome", "Verdict", "segment_digest",
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


@dataclass(frozen=True, slots=True)
class Verdict:
    """The comparison of a request with an earlier one. ``reason``: the first segment that
    changed (a segment's name, or ``messages``), ``evicted`` (nothing changed, the cache served
    less than the earlier request left), or None (nothing changed, the cache served it).
    ``missed_tokens``: of the earlier request's reusable tokens, those this one could not reuse;
    ``reusable_tokens``: the earlier request's (its full blocks)."""

    reason: str | None
    missed_tokens: int
    reusable_tokens: int


class Diagnoser:
    """The fingerprints of recent requests, per scope, at most ``max_entries`` (the oldest go
    first) and each for ``ttl_s`` seconds; thread safe."""

    def __init__(self, block_size: int, max_entries: int = DEFAULT_MAX_ENTRIES,
                 ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.block_size = block_size
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, Fingerprint]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, scope: str, response_id: str, fingerprint: Fingerprint) -> None:
        with self._lock:
            self._entries[(scope, response_id)] = (self.clock() + self.ttl_s, fingerprint)
            self._entries.move_to_end((scope, response_id))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def find(self, scope: str, response_id: str) -> Fingerprint | None:
        """The fingerprint ``scope`` left under ``response_id`` (None: never, expired, evicted
        from the store, or another scope's)."""
        with self._lock:
            entry = self._entries.get((scope, response_id))
            if entry is None:
                return None
            expires_at, fingerprint = entry
            if expires_at <= self.clock():
                del self._entries[(scope, response_id)]
                return None
            return fingerprint

    def compare(self, earlier: Fingerprint, now: Fingerprint, num_cached: int) -> Verdict:
        """``now`` (which the cache served ``num_cached`` tokens of) against ``earlier``."""
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
            return Verdict("evicted", could - num_cached, reusable)
        return Verdict(None, 0, reusable)


NOT_FOUND = "not_found"  # the earlier id names no fingerprint of this scope
Outcome = Verdict | str | None  # a verdict, NOT_FOUND, or None: nothing to compare with


class Diagnosis:
    """One request's diagnostics: its ``fingerprint``, compared with the one ``earlier_id``
    left (None: nothing to compare, the request only opts in) once its prefill is done, and
    left under its own id for the next request. ``on_reason`` counts each reason given."""

    def __init__(self, diagnoser: Diagnoser, scope: str, fingerprint: Fingerprint,
                 earlier_id: str | None,
                 on_reason: Callable[[str], None] = lambda reason: None) -> None:  # fmt: skip
        self.diagnoser = diagnoser
        self.scope = scope
        self.fingerprint = fingerprint
        self.earlier_id = earlier_id
        self.on_reason = on_reason
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
            earlier = diagnoser.find(self.scope, self.earlier_id)
            self._outcome = NOT_FOUND if earlier is None else diagnoser.compare(
                earlier, self.fingerprint, num_cached)
            reason = self._outcome if isinstance(self._outcome, str) else self._outcome.reason
            self.on_reason(reason or "none")
        diagnoser.remember(self.scope, response_id, self.fingerprint)
        return self._outcome
