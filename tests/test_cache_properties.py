"""Property test: random interleavings of the contract API against a simple reference model.

The state machine is written against `PrefixCache` only; each implementation gets a subclass
that names its kind (``HashCacheMachine`` below; add one per kind). After every step the cache's
`check_integrity()` runs, and every `match` must agree with the model's hit length.

The model: the set of digests that should be hittable. A commit adds the digests of the
sequence's newly committed blocks (computed independently with `BlockHasher.chain`);
`BlockRemoved` events take digests away (the model cannot guess which blocks a policy evicts,
but it checks that an eviction never touches a block a live sequence holds); a successful reset
clears it. Allocation success is predicted from the live block tables (hit blocks no live
sequence holds count as consumed; a shared write block costs one copy).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache.cache import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    CacheHit,
    Namespace,
    PrefixCache,
    Sequence,
    make_prefix_cache,
)

BS = 4
SALTS = [None, None, None, "tenant-a", "tenant-b"]
BASES = [list(range(1, 41)), [9] * 40, [1, 2, 3, 4] * 10]  # shared streams make prefixes meet


class CacheMachine(RuleBasedStateMachine):
    """The kind-agnostic state machine; subclasses set ``kind``."""

    kind = "hash"

    def __init__(self) -> None:
        super().__init__()
        self.hasher = BlockHasher(BS)
        self.cache: PrefixCache | None = None
        self.num_blocks = 0
        self.cached: set[bytes] = set()
        self.live: dict[str, Sequence] = {}
        self.alloc_end: dict[str, int] = {}
        self.next_id = 0

    @initialize(num_blocks=st.integers(4, 12))
    def build(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cache = make_prefix_cache(self.kind, num_blocks=num_blocks, block_size=BS)

    @property
    def c(self) -> PrefixCache:
        assert self.cache is not None
        return self.cache

    # -- model helpers --------------------------------------------------------------------------

    def chain(self, seq: Sequence) -> list[bytes]:
        return self.hasher.chain(seq.token_ids, Namespace(model="", salt=seq.salt))

    def model_hit_blocks(self, seq: Sequence) -> int:
        if not seq.writes_cache:
            return 0
        num = 0
        for digest in self.chain(seq)[: (seq.num_tokens - 1) // BS]:
            if digest not in self.cached:
                break
            num += 1
        return num

    def held(self, exclude: str | None = None) -> dict[int, int]:
        counts: dict[int, int] = {}
        for seq_id, seq in self.live.items():
            if seq_id != exclude:
                for block_id in self.c.block_table(seq):
                    counts[block_id] = counts.get(block_id, 0) + 1
        return counts

    def absorb_events(self, holder: str | None = None) -> list[BlockStored]:
        """Apply removals and resets to the model; return the stored events for the caller."""
        stored = []
        for event in self.c.take_events():
            if isinstance(event, BlockRemoved):
                others = self.held(exclude=holder)
                assert not set(event.block_ids) & set(others), "evicted a block a sequence holds"
                assert set(event.block_hashes) <= self.cached, "removed a digest never stored"
                self.cached -= set(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.cached.clear()
            else:
                stored.append(event)
        return stored

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    # -- rules ----------------------------------------------------------------------------------

    seqs = st.builds(
        lambda base, prefix, tail, salt, use_cache: (
            BASES[base][:prefix] + tail or [0],
            salt,
            use_cache,
        ),
        st.integers(0, len(BASES) - 1),
        st.integers(0, 16),
        st.lists(st.integers(0, 3), max_size=5),
        st.sampled_from(SALTS),
        st.sampled_from([True, True, True, False]),
    )

    def new_seq(self, spec: tuple[list[int], Any, bool]) -> Sequence:
        tokens, salt, use_cache = spec
        return Sequence(self.new_id(), tokens, salt, use_cache=use_cache)

    def checked_match(self, seq: Sequence) -> CacheHit:
        hit = self.c.match(seq)
        num_hit = self.model_hit_blocks(seq)
        assert hit.num_tokens == num_hit * BS, f"hit {hit.num_tokens} != model {num_hit * BS}"
        assert len(hit.block_ids) == num_hit
        return hit

    @rule(spec=seqs, roll=st.integers(0, 15))
    def probe_or_reset(self, spec: tuple[list[int], Any, bool], roll: int) -> None:
        """Mostly a lookup that allocates nothing; sometimes a reset."""
        if roll:
            self.checked_match(self.new_seq(spec))
            return
        in_use = any(self.c.block_table(s) for s in self.live.values())
        assert self.c.reset() is not in_use
        self.absorb_events()
        if not in_use:
            assert not self.cached, "a successful reset emits AllBlocksCleared"

    @rule(spec=seqs, keep=st.booleans())
    def prefill(self, spec: tuple[list[int], Any, bool], keep: bool) -> None:
        """The common life: admit the whole prompt, commit it, maybe finish at once."""
        seq = self.admit(spec, chunk=10**6)
        if seq is None:
            return
        old_blocks = seq.num_computed_tokens // BS
        self.c.commit(seq, seq.num_tokens)
        self.check_stored(seq, old_blocks, seq.num_tokens // BS)
        if not keep:
            self.drop(seq.seq_id)

    @rule(spec=seqs, chunk=st.integers(1, 24))
    def admit_chunk(self, spec: tuple[list[int], Any, bool], chunk: int) -> None:
        self.admit(spec, chunk)

    def admit(self, spec: tuple[list[int], Any, bool], chunk: int) -> Sequence | None:
        """match + allocate the first ``chunk`` tokens, checked against the model."""
        seq = self.new_seq(spec)
        hit = self.checked_match(seq)
        num_hit = len(hit.block_ids)
        num_new = min(chunk, seq.num_tokens - hit.num_tokens)
        held = self.held()
        consumed = sum(1 for b in hit.block_ids if b not in held)
        need = -(-(hit.num_tokens + num_new) // BS) - num_hit + consumed
        fits = need <= self.num_blocks - len(held)
        before = self.snapshot()
        table = self.c.allocate(seq, num_new, hit)
        if not fits:
            assert table is None, "allocation should not fit"
            assert self.snapshot() == before, "a failed allocation changed something"
            return None
        assert table is not None, "allocation should fit"
        assert table[:num_hit] == hit.block_ids
        assert len(table) == -(-(hit.num_tokens + num_new) // BS)
        assert seq.num_computed_tokens == hit.num_tokens
        self.absorb_events(holder=seq.seq_id)
        self.live[seq.seq_id] = seq
        self.alloc_end[seq.seq_id] = hit.num_tokens + num_new
        return seq

    def snapshot(self) -> tuple[object, ...]:
        tables = {k: self.c.block_table(s) for k, s in self.live.items()}
        return tables, self.c.num_free_blocks

    def pick(self, data: st.DataObject, ready: bool) -> Sequence | None:
        """A live sequence; ``ready``: one with no allocated-but-uncommitted tokens."""
        ids = [k for k, s in self.live.items() if (self.alloc_end[k] == s.num_computed_tokens)]
        if not ready:
            ids = [k for k in self.live if k not in ids]
        if not ids:
            return None
        return self.live[data.draw(st.sampled_from(sorted(ids)))]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = self.pick(data, ready=False)
        if seq is None:
            return
        end = self.alloc_end[seq.seq_id]
        upto = data.draw(st.sampled_from([end]) | st.integers(seq.num_computed_tokens, end))
        old_blocks = seq.num_computed_tokens // BS
        self.c.commit(seq, upto)
        assert seq.num_computed_tokens == upto
        self.check_stored(seq, old_blocks, upto // BS)

    def check_stored(self, seq: Sequence, start: int, end: int) -> None:
        stored = self.absorb_events(holder=seq.seq_id)
        if not seq.writes_cache:
            assert not stored, "a sequence outside the cache stored blocks"
            return
        chain = self.chain(seq)
        new = [d for d in chain[start:end] if d not in self.cached]
        got = [d for event in stored for d in event.block_hashes]
        assert got == new, "BlockStored events differ from the newly committed blocks"
        for event in stored:
            first = chain.index(event.block_hashes[0])
            parent = chain[first - 1] if first else self.hasher.root(Namespace(salt=seq.salt))
            assert event.parent_block_hash == parent
            last = first + len(event.block_hashes)
            assert event.token_ids == seq.token_ids[first * BS : last * BS]
        self.cached.update(chain[start:end])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3), num=st.integers(1, 6))
    def extend(self, data: st.DataObject, token: int, num: int) -> None:
        """Decode one token, or the next prefill chunk."""
        seq = self.pick(data, ready=True)
        if seq is None:
            return
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append(token)
        computed = seq.num_computed_tokens
        num = min(num, seq.num_tokens - computed)
        table = self.c.block_table(seq)
        others = self.held(exclude=seq.seq_id)
        write = computed // BS
        cow = 1 if write < len(table) and table[write] in others else 0
        need = max(0, -(-(computed + num) // BS) - len(table)) + cow
        fits = need <= self.num_blocks - len(set(table) | set(others))
        before = self.snapshot()
        result = self.c.allocate(seq, num)
        if not fits:
            assert result is None and self.snapshot() == before
            return
        assert result is not None and result[:write] == table[:write]
        copies = self.c.take_block_copies()
        assert copies == ([(table[write], result[write])] if cow and computed % BS else [])
        self.absorb_events(holder=seq.seq_id)
        self.alloc_end[seq.seq_id] = computed + num

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = self.pick(data, ready=True)
        if seq is None:
            return
        child = self.c.fork(seq, self.new_id())
        assert self.c.block_table(child) == self.c.block_table(seq)
        assert child.num_computed_tokens == seq.num_computed_tokens
        self.live[child.seq_id] = child
        self.alloc_end[child.seq_id] = child.num_computed_tokens

    @precondition(lambda self: len(self.live) > 1)
    @rule(data=st.data())
    def free_more(self, data: st.DataObject) -> None:
        self.free(data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.drop(data.draw(st.sampled_from(sorted(self.live))))

    def drop(self, seq_id: str) -> None:
        seq = self.live.pop(seq_id)
        del self.alloc_end[seq_id]
        self.c.free(seq)
        self.c.free(seq)  # a second free is a no-op
        assert self.c.block_table(seq) == []

    @invariant()
    def integrity(self) -> None:
        if self.cache is None:
            return
        self.cache.check_integrity()
        held = self.held()
        assert self.cache.num_free_blocks == self.num_blocks - len(held)


class HashCacheMachine(CacheMachine):
    kind = "hash"


PROPERTY_SETTINGS = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHashCacheProperties = HashCacheMachine.TestCase
TestHashCacheProperties.settings = PROPERTY_SETTINGS


class RadixCacheMachine(CacheMachine):
    kind = "radix"


TestRadixCacheProperties = RadixCacheMachine.TestCase
TestRadixCacheProperties.settings = PROPERTY_SETTINGS
