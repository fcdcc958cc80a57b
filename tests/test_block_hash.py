"""Block identity: golden vectors, canonical encoding, chaining, incremental hashing, the lab."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import BlockExtra, BlockHasher, Namespace, Sequence
from prefixcache.cache.block_hash import encode_block, encode_namespace, get_hash_fn
from prefixcache.tools.lab import run_lab

LAB_NS = Namespace(model="prefixcache-lab", salt="tenant-a")


def _hasher(algo: str, block_size: int = 4) -> BlockHasher:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlockHasher(block_size, algo)


# --- golden vectors (docs/block-key.md) ----------------------------------------------------------


def test_golden_namespace_bytes_and_roots() -> None:
    sha = _hasher("sha256")
    empty = Namespace()
    assert encode_namespace(empty).hex() == "50434e530101000000008200000000" + "8300000000"
    assert sha.root(empty).hex() == (
        "b88a5e7d6bd08bce16d757eda1bd6219cb2b9b1cbebdd55499e2ee3966531b2f"
    )
    assert sha.root(Namespace(model="tiny", adapter="X")).hex() == (
        "a1d64f4aa6a18bc3285a120d9cec25c0442d31ba62a01c9d51f09a7e04ae957c"
    )
    assert sha.root(Namespace(model="tiny", salt="X")).hex() == (
        "27413cdcd16f1d13928e69daaa3686c22c91454569ca41b66efe5a0484febed2"
    )
    layout = Namespace(model="tiny", kv_layout="int8:q8_0/32")
    assert encode_namespace(layout).hex() == (
        "50434e5301010000000474696e7982000000008300000000040000000c696e74383a71385f302f3332"
    )
    assert sha.root(layout).hex() == (
        "39c3f314f87229bdeb1f6a07733b6c8ad85c50c54343d1f87a185dccb9db3b2d"
    )
    assert sha.root(Namespace(model="tiny", kv_layout=None)).hex() == (  # the model's dtype
        "2f80a01b5b73574d0cd9ee9b3e135e5e3fa525d01f34c8287d0d47f8ec3d7ed8"
    )


def test_golden_public_namespace_and_the_root_that_follows_it() -> None:
    sha = BlockHasher(4)
    public = Namespace(model="tiny", public=True)
    assert encode_namespace(public).hex() == (
        "50434e5301010000000474696e79820000000083000000000500000000"
    )
    assert sha.root(public).hex() == (
        "1dcab16356f768c24202a77d57b97d443ece31dbe8b64c447743b13a656f9cf7"
    )
    (first,) = sha.chain([1, 2, 3, 4], public)
    assert first.hex() == "93109d21d453e14ce2a4f1e27b5f441055726cd2d4d75057397d104934ecc00f"
    follows = Namespace(model="tiny", salt="X", follows=first)
    assert sha.root(follows).hex() == (
        "b3b210dcd780da46598fe9731e58bb6f31098b5b354c990c77ec9c29b8bcd205"
    )
    seq = Sequence("s", range(1, 9), "X", public_blocks=1)
    assert [d.hex() for d in seq.digests(sha, "tiny")] == [
        "93109d21d453e14ce2a4f1e27b5f441055726cd2d4d75057397d104934ecc00f",
        "b360734145ef55b8061269feb3f80ebd4e824adea417e072d0f80796d372d52b",
    ]


def test_golden_block_bytes_and_chain() -> None:
    sha = _hasher("sha256")
    root = sha.root(LAB_NS)
    assert root.hex() == "60429960da3338fd98c10293534dfdecb974207dd90cbcbd1691fa3ddfc23839"
    payload = encode_block(root, [1, 2, 3, 4])
    assert payload.hex() == (
        "5043424b01" "1100000010" "00000001000000020000000300000004" "1000000020" + root.hex()
    )
    assert [d.hex() for d in sha.chain(list(range(1, 13)), LAB_NS)] == [
        "391d385c17d3012a0f7ac2de60809c8afb9d2238495df61668a7af16d30bafee",
        "3cf9516d7df78e39e9646bced0242165c9163f7f225541ac5a1d2647ad5fa17c",
        "5e47c6e34a6820c7b8bc71e7a71f8b0fdbd88afebfa36b275e029bdef16094df",
    ]


def test_golden_block_with_extra() -> None:
    sha = _hasher("sha256")
    extra = BlockExtra(kind="image", identity=bytes.fromhex("ab" * 32), offset=2)
    digest = sha.block(sha.root(LAB_NS), [1, 2, 3, 4], [extra])
    assert digest.hex() == "fc8dc083d23bf1bdbfcea8fae51ea7c06341352cf8064540772e6ccb6091c95e"
    chained = sha.chain([1, 2, 3, 4], LAB_NS, extras=lambda i: [extra] if i == 0 else [])
    assert chained == [digest]


def test_golden_other_algorithms() -> None:
    blake = _hasher("blake2b")
    assert blake.root(LAB_NS).hex() == (
        "4c130b823b81c8f36c5e192e3d5317e99488cca8a1f402b8bbe685c643b4ea28"
    )
    assert blake.chain([1, 2, 3, 4], LAB_NS)[0].hex() == (
        "0c23f833c79846ea9da07ccdafeb2e20bacf720b62fe4a5287809c64e857c293"
    )
    xxh = _hasher("xxh3_128")
    assert xxh.root(LAB_NS).hex() == "fb8c7d3eff280d860d23219b62021925"
    assert xxh.chain([1, 2, 3, 4], LAB_NS)[0].hex() == "4467bd30c40995dd0dbadaf87cdf7e6b"


# --- encoding rules -------------------------------------------------------------------------------


def test_typed_fields_never_collide() -> None:
    sha = _hasher("sha256")
    assert sha.root(Namespace(adapter="X")) != sha.root(Namespace(salt="X"))
    assert sha.root(Namespace(model="org_1", salt="2345")) != sha.root(
        Namespace(model="org_12345", salt="")
    )
    assert sha.root(Namespace(salt="")) != sha.root(Namespace(salt=None))
    assert sha.root(Namespace(model="m", adapter="a")) != sha.root(Namespace(model="ma"))


def test_only_complete_blocks_have_identity() -> None:
    sha = _hasher("sha256", block_size=4)
    assert len(sha.chain(list(range(10)))) == 2  # 10 tokens, block size 4: 8 reusable


def test_digest_widths_and_xxh3_warns() -> None:
    assert len(_hasher("sha256").root(Namespace())) == 32
    assert len(_hasher("blake2b").root(Namespace())) == 32
    with pytest.warns(UserWarning, match="not collision-resistant"):
        BlockHasher(16, "xxh3_128")
    with pytest.raises(ValueError, match="unknown hash_algo"):
        get_hash_fn("md5")


def test_token_ids_out_of_range_are_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        _hasher("sha256").chain([1, 2, 3, -1])
    with pytest.raises(ValueError, match="token ids"):
        _hasher("sha256").chain([1, 2, 3, 2**32])


@pytest.mark.parametrize("algo", ["sha256", "blake2b", "xxh3_128"])
@pytest.mark.parametrize("num_tokens", [3, 16 * 7 + 5, 16 * 40])
def test_bulk_and_small_paths_agree_with_the_reference_encoding(algo: str, num_tokens: int) -> None:
    hasher = _hasher(algo, block_size=16)
    tokens = [(i * 7919) % 50_000 for i in range(num_tokens)]
    root = hasher.root(LAB_NS)
    expected, parent = [], root
    for i in range(num_tokens // 16):
        parent = hasher.block(parent, tokens[i * 16 : (i + 1) * 16])
        expected.append(parent)
    assert hasher.chain(tokens, LAB_NS) == expected
    assert hasher.chain(tuple(tokens), LAB_NS) == expected  # not a list: the other conversion


def test_incremental_bulk_path_with_chunks_equals_block_by_block() -> None:
    # 10 blocks, then 301 more continuing the chain (each block's hash continues a state that
    # has consumed the constant prefix); ids that are multiples of 256 end in a NUL byte, which
    # the token chunks must keep.
    hasher = _hasher("sha256", block_size=512)
    tokens = [(i * 256) % 2**32 if i % 3 else (i * 7919) % 150_000 for i in range(512 * 311)]
    root = hasher.root(LAB_NS)
    digests: list[bytes] = []
    chunks: list[bytes] = []
    assert hasher.extend(digests, root, tokens[: 512 * 10 + 7], chunks=chunks) == 10
    assert hasher.extend(digests, root, tokens, chunks=chunks) == 301
    expected, parent = [], root
    for i in range(311):
        parent = hasher.block(parent, tokens[i * 512 : (i + 1) * 512])
        expected.append(parent)
    assert digests == expected
    assert chunks == [
        b"".join(t.to_bytes(4, "big") for t in tokens[i * 512 : (i + 1) * 512]) for i in range(311)
    ]


def test_hasher_survives_pickle_and_deepcopy() -> None:
    hasher = _hasher("blake2b", block_size=16)
    tokens = list(range(16 * 20))
    expected = hasher.chain(tokens, LAB_NS)
    for clone in (pickle.loads(pickle.dumps(hasher)), copy.deepcopy(hasher)):
        assert (clone.algo, clone.block_size) == ("blake2b", 16)
        assert clone.chain(tokens, LAB_NS) == expected


def test_one_hasher_shared_by_threads_gives_each_its_own_digests() -> None:
    hasher = _hasher("sha256", block_size=16)
    prompts = [[(i * 31 + k) % 150_000 for i in range(16 * (200 + k))] for k in range(6)]
    expected = [hasher.chain(p, LAB_NS) for p in prompts]
    with ThreadPoolExecutor(max_workers=6) as pool:
        for _ in range(5):
            assert list(pool.map(lambda p: hasher.chain(p, LAB_NS), prompts)) == expected


def test_incremental_extension_equals_one_shot_and_never_rehashes() -> None:
    hasher = _hasher("sha256", block_size=4)
    tokens = list(range(100, 150))
    seq = Sequence("s", tokens[:5], salt="tenant-a")
    assert len(seq.digests(hasher, "m")) == 1
    first = seq.block_digests[0]
    for t in tokens[5:]:
        seq.append(t)
        seq.digests(hasher, "m")
    assert seq.block_digests[0] is first  # the same object: not recomputed
    assert seq.block_digests == hasher.chain(tokens, Namespace(model="m", salt="tenant-a"))
    assert len(seq.block_token_bytes) == len(seq.block_digests)
    assert seq.block_token_bytes[1] == b"".join(t.to_bytes(4, "big") for t in tokens[4:8])


# --- properties -----------------------------------------------------------------------------------

_tokens = st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=32)
_names = st.one_of(st.none(), st.text(max_size=6))


def test_100k_distinct_blocks_have_distinct_digests() -> None:
    import random

    hasher = _hasher("sha256", block_size=4)
    rng = random.Random(1)
    seen: dict[bytes, tuple[object, ...]] = {}
    roots = [hasher.root(Namespace(model="m", salt=f"s{i}")) for i in range(10)]
    while len(seen) < 100_000:
        key = (rng.randrange(10), tuple(rng.randrange(1 << 17) for _ in range(4)))
        digest = hasher.block(roots[key[0]], key[1])
        assert seen.setdefault(digest, key) == key, "two distinct blocks share a digest"


@settings(max_examples=200, deadline=None)
@given(tokens=_tokens, data=st.data())
def test_single_token_change_changes_that_block_and_all_later(tokens: list[int], data) -> None:
    hasher = _hasher("sha256", block_size=4)
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = (changed[position] + 1) % 2**32
    a, b = hasher.chain(tokens), hasher.chain(changed)
    block = position // 4
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:], strict=True))


@settings(max_examples=200, deadline=None)
@given(tokens=_tokens, ns_a=st.tuples(st.text(max_size=4), _names, _names),
       ns_b=st.tuples(st.text(max_size=4), _names, _names))
def test_different_namespaces_share_no_block(tokens: list[int], ns_a, ns_b) -> None:
    hasher = _hasher("sha256", block_size=4)
    a = hasher.chain(tokens, Namespace(*ns_a))
    b = hasher.chain(tokens, Namespace(*ns_b))
    if ns_a == ns_b:
        assert a == b
    else:
        assert not set(a) & set(b)


def test_digests_are_equal_across_processes() -> None:
    code = (
        "import json; from prefixcache.cache import BlockHasher, Namespace;"
        "h = BlockHasher(4);"
        "print(json.dumps([d.hex() for d in h.chain(list(range(1, 13)), "
        "Namespace(model='prefixcache-lab', salt='tenant-a'))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert json.loads(out.stdout) == [d.hex() for d in _hasher("sha256").chain(
        list(range(1, 13)), LAB_NS)]


# --- the lab --------------------------------------------------------------------------------------


def test_lab_prints_the_spec_lines() -> None:
    assert run_lab() == ["same prefix: (2, 8)", "one token changed: (1, 4)",
                         "different salt: (0, 0)"]


def test_lab_variations() -> None:
    assert run_lab(block_size=2)[:2] == ["same prefix: (4, 8)", "one token changed: (3, 6)"]
    assert run_lab(use_salt=False)[2] == "different salt: (2, 8)"


def test_lab_cli_and_explain() -> None:
    run = [sys.executable, "-m", "prefixcache"]
    out = subprocess.run([*run, "lab"], capture_output=True, text=True, check=True).stdout
    assert out == "same prefix: (2, 8)\none token changed: (1, 4)\ndifferent salt: (0, 0)\n"
    out = subprocess.run([*run, "lab", "--explain"], capture_output=True, text=True,
                         check=True).stdout
    assert "block 1  tokens [4, 8)" in out and "FIRST MISS" in out
    bad = subprocess.run([*run, "lab", "--block-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--block-size must be >= 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_sequence_copies_its_token_ids_unless_handed_a_list() -> None:
    prompt = list(range(40))
    seq = Sequence("s", prompt)
    seq.append(99)
    assert prompt == list(range(40))  # the caller's list is untouched
    adopted = Sequence("t", prompt, copy=False)
    assert adopted.token_ids is prompt
    assert Sequence("u", range(40), copy=False).token_ids == list(range(40))  # not a list: copied
    hasher = _hasher("sha256", block_size=16)
    assert adopted.digests(hasher, "m") == seq.digests(hasher, "m")
