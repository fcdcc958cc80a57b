"""Declared public prefixes at the cache level: the exact split rule, and property tests (over
random declared sets, permissions and prompts) that every cached block is in the namespace the
rule gives it — public exactly for the whole declared blocks of a permitted tenant's prompt,
salted otherwise — in both caches, and that no tenant hits another's blocks past the public part.

The reference chain is built from the block primitives (`BlockHasher.root`/`block`), not from
`Sequence`, so the split is checked against an independent computation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.cache import (
    PUBLIC_DOMAIN,
    BlockHasher,
    Namespace,
    PrefixCache,
    PublicPrefixes,
    Sequence,
    make_prefix_cache,
)
from prefixcache.cache.public import num_common_tokens
from prefixcache.cache.radix_cache import RadixIndex

BS = 4
TENANTS = ["a", "b", "c"]


def reference_chain(token_ids: list[int], salt: str, num_public: int) -> list[bytes]:
    """The digests the rule gives: public blocks from the public root, then the salted chain
    that follows the last public block (or the tenant's root)."""
    hasher = BlockHasher(BS)
    num_blocks = len(token_ids) // BS
    digests: list[bytes] = []
    parent = hasher.root(Namespace(public=True))
    for i in range(num_public):
        parent = hasher.block(parent, token_ids[i * BS : (i + 1) * BS])
        digests.append(parent)
    follows = digests[-1] if digests else None
    parent = hasher.root(Namespace(salt=salt, follows=follows))
    for i in range(num_public, num_blocks):
        parent = hasher.block(parent, token_ids[i * BS : (i + 1) * BS])
        digests.append(parent)
    return digests


def cached_domains(cache: PrefixCache) -> dict[bytes, str]:
    """Every cached block's digest and the domain it is cached in."""
    index = cache.index
    if isinstance(index, RadixIndex):
        return {d: node.domain for node in index.nodes() for d in node.digests}
    return {b.digest: b.domain for b in cache.pool.blocks if b.digest is not None}


# -- the rule -------------------------------------------------------------------------------------


def test_whole_declared_blocks_only() -> None:
    declared = list(range(100, 100 + 2010))
    prefixes = PublicPrefixes({"system": declared})
    prompt = declared + [7] * 50
    assert prefixes.num_public_blocks(prompt, ["system"], 16) == 125  # 2,000 of 2,010 tokens
    assert prefixes.num_public_blocks(prompt, [], 16) == 0  # not permitted
    assert prefixes.num_public_blocks(prompt, ["other"], 16) == 0
    diverged = declared[:1000] + [0] + declared[1001:]
    assert prefixes.num_public_blocks(diverged, ["system"], 16) == 62  # 992 tokens before it
    assert prefixes.num_public_blocks(declared[:40], ["system"], 16) == 2  # a shorter prompt


def test_longest_permitted_prefix_wins() -> None:
    prefixes = PublicPrefixes({"short": [1] * 8, "long": [1] * 20, "tiny": [1] * 3})
    prompt = [1] * 30
    assert prefixes.num_public_blocks(prompt, ["short", "long", "tiny"], BS) == 5
    assert prefixes.num_public_blocks(prompt, ["short"], BS) == 2
    assert prefixes.num_public_blocks(prompt, ["tiny"], BS) == 0  # no whole block


@given(st.lists(st.integers(0, 3), max_size=200), st.lists(st.integers(0, 3), max_size=200))
def test_common_tokens(a: list[int], b: list[int]) -> None:
    expected = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    assert num_common_tokens(a, b) == expected


def test_split_chain_matches_reference_and_keeps_old_keys() -> None:
    hasher = BlockHasher(BS)
    tokens = list(range(1, 23))
    seq = Sequence("s", tokens, "tenant-a", public_blocks=3)
    assert seq.digests(hasher, "") == reference_chain(tokens, "tenant-a", 3)
    plain = Sequence("p", tokens, "tenant-a")
    assert plain.digests(hasher, "") == hasher.chain(tokens, Namespace(salt="tenant-a"))
    assert seq.block_domain(2) == PUBLIC_DOMAIN and seq.block_domain(3) == ""
    seq.append(5)
    seq.append(6)  # a decode fills block 5: chained under the salt, incrementally
    assert seq.digests(hasher, "") == reference_chain(seq.token_ids, "tenant-a", 3)


def test_public_blocks_beyond_the_prompt_are_refused() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        Sequence("s", [1] * 9, "x", public_blocks=3).digests(BlockHasher(BS), "")
    with pytest.raises(ValueError, match=">= 0"):
        Sequence("s", [1] * 9, "x", public_blocks=-1)


def test_isolation_none_has_no_public_blocks() -> None:
    assert Sequence("s", [1] * 9, "x", public_blocks=2, use_cache=False).public_blocks == 0


# -- property: every block's namespace, both caches -----------------------------------------------


@dataclass(frozen=True)
class Scenario:
    declared: dict[str, list[int]]
    permits: dict[str, list[str]]  # tenant -> the prefixes it may use
    requests: list[tuple[str, list[int]]]  # (tenant, prompt)


def _prompts(declared: list[list[int]]) -> st.SearchStrategy[list[int]]:
    """A declared prefix cut anywhere, maybe changed at one token, plus a continuation."""
    sources = st.sampled_from(declared) if declared else st.just([])
    return st.builds(
        lambda src, cut, change, tail: _edit(src[:cut], change) + tail,
        sources,
        st.integers(0, 40),
        st.one_of(st.none(), st.integers(0, 40)),
        st.lists(st.integers(0, 3), max_size=12),
    )


def _edit(tokens: list[int], at: int | None) -> list[int]:
    if at is None or at >= len(tokens):
        return tokens
    return tokens[:at] + [tokens[at] + 1] + tokens[at + 1 :]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    names = ["p0", "p1", "p2"][: draw(st.integers(1, 3))]
    base = draw(st.lists(st.integers(0, 3), min_size=4, max_size=30))
    # declared prefixes often share a beginning (one system prompt, two tool lists)
    declared = {n: base[: draw(st.integers(0, len(base)))]
                + draw(st.lists(st.integers(0, 3), max_size=10)) for n in names}  # fmt: skip
    permits = {t: draw(st.lists(st.sampled_from(names), unique=True)) for t in TENANTS}
    requests = draw(st.lists(st.tuples(st.sampled_from(TENANTS),
                                       _prompts(list(declared.values()))),
                             min_size=1, max_size=12))  # fmt: skip
    return Scenario(declared, permits, requests)


def _run(kind: str, scenario: Scenario, num_blocks: int = 256) -> None:
    """Every request of ``scenario`` through a cache of ``num_blocks`` (256: nothing is ever
    evicted; fewer: evictions, and requests that do not fit are skipped)."""
    cache = make_prefix_cache(kind, num_blocks=num_blocks, block_size=BS)
    prefixes = PublicPrefixes(scenario.declared)
    expected: dict[bytes, str] = {}  # digest -> domain, from the reference chains
    for i, (tenant, prompt) in enumerate(scenario.requests):
        if not prompt:
            continue
        num_public = prefixes.num_public_blocks(prompt, scenario.permits[tenant], BS)
        reference = reference_chain(prompt, f"salt-{tenant}", num_public)
        seq = Sequence(f"r{i}", prompt, f"salt-{tenant}", domain=tenant, public_blocks=num_public)
        hit = cache.match(seq)
        # the hit never reaches a block the tenant did not cache, past the public part
        for j, digest in enumerate(reference[: hit.num_blocks]):
            assert j < num_public or expected.get(digest) == tenant
        if cache.allocate(seq, len(prompt) - hit.num_tokens, hit) is None:
            assert num_blocks < 256
            continue
        cache.commit(seq, len(prompt))
        cache.check_integrity()
        assert cache.identity.block_digests(seq) == reference
        for j, digest in enumerate(reference):
            expected[digest] = PUBLIC_DOMAIN if j < num_public else tenant
        cache.free(seq)
        cache.check_integrity()
    cached = cached_domains(cache)
    assert cached.items() <= expected.items()
    if num_blocks == 256:
        assert cached == expected  # nothing evicted: 256 blocks hold every request
    public = {d for d, dom in expected.items() if dom == PUBLIC_DOMAIN}
    assert public <= _declared_public_digests(scenario)


def _declared_public_digests(scenario: Scenario) -> set[bytes]:
    """The public chain of every whole block of every declared prefix some tenant may use."""
    used = {n for names in scenario.permits.values() for n in names}
    out: set[bytes] = set()
    for name in used:
        ids = scenario.declared[name]
        out |= set(reference_chain(ids, "", len(ids) // BS))
    return out


@pytest.mark.parametrize("kind", ["hash", "radix"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_every_block_in_its_namespace(kind: str, scenario: Scenario) -> None:
    _run(kind, scenario)


@pytest.mark.parametrize("kind", ["hash", "radix"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), num_blocks=st.integers(4, 16))
def test_every_block_in_its_namespace_under_eviction(
    kind: str, scenario: Scenario, num_blocks: int
) -> None:
    _run(kind, scenario, num_blocks)


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_a_continuation_is_the_tenants_own(kind: str) -> None:
    """Tenant a sends declared + secret; tenant b, also permitted, probes declared + secret
    and declared + other: both hit the public blocks alone."""
    cache = make_prefix_cache(kind, num_blocks=64, block_size=BS)
    declared = list(range(10, 10 + 18))  # 4 whole blocks, 2 tokens left over
    prefixes = PublicPrefixes({"sys": declared})
    secret, other = [1, 2, 3, 1, 2, 3, 1, 2], [3, 2, 1, 3, 2, 1, 3, 2]

    def seq(tenant: str, tail: list[int], sid: str) -> Sequence:
        prompt = declared + tail
        return Sequence(
            sid,
            prompt,
            tenant,
            domain=tenant,
            public_blocks=prefixes.num_public_blocks(prompt, ["sys"], BS),
        )

    writer = seq("a", secret, "w")
    hit = cache.match(writer)
    assert cache.allocate(writer, writer.num_tokens - hit.num_tokens, hit) is not None
    cache.commit(writer, writer.num_tokens)
    cache.free(writer)
    cache.check_integrity()
    probes = [cache.match(seq("b", tail, f"p{i}")) for i, tail in enumerate([secret, other])]
    assert [p.num_tokens for p in probes] == [16, 16]
    again = cache.match(seq("a", secret, "again"))
    assert again.num_tokens == 24  # the writer's own continuation: 6 whole blocks, last held back


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_zero_on_reuse_still_zeroes_a_tenants_block_for_another(kind: str) -> None:
    """a's own blocks after the public ones go to b zeroed, as any block changing namespace
    does: the public prefix they follow is the same, the salt is not."""
    cache = make_prefix_cache(kind, num_blocks=4, block_size=BS, zero_on_reuse=True)
    declared = [5, 6, 7, 8, 9, 10, 11, 12]  # 2 public blocks
    prefixes = PublicPrefixes({"sys": declared})

    def run(tenant: str, tail: list[int]) -> list[int]:
        prompt = declared + tail
        seq = Sequence(
            tenant,
            prompt,
            tenant,
            domain=tenant,
            public_blocks=prefixes.num_public_blocks(prompt, ["sys"], BS),
        )
        hit = cache.match(seq)
        table = cache.allocate(seq, len(prompt) - hit.num_tokens, hit)
        assert table is not None
        cache.commit(seq, len(prompt))
        cache.free(seq)
        cache.check_integrity()
        return table

    first = run("a", [1, 2, 3, 4, 1, 2, 3])  # 2 public blocks, 1 of a's own, a partial one
    cache.pool.take_blocks_to_zero()  # a's first allocation: fresh blocks
    second = run("b", [4, 3, 2, 1, 4, 3, 2])
    assert second[:2] == first[:2]  # the public blocks, shared
    assert set(cache.pool.take_blocks_to_zero()) == set(second[2:])  # a's, zeroed for b
