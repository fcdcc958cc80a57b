"""Every reader of a file a user hands us, fuzzed: GGUF, safetensors, tokenizer.json, chat
templates, tenants and secret files, and each trace format (targets in `fuzz_targets`).

Hypothesis mutates each target's valid seed (truncations, bit flips, inserted bytes, extreme
integers written over fields, numbers spliced into text) and also feeds raw bytes; each input must
be accepted or refused with the reader's own error naming the file: never another exception, a
hang (pytest-timeout) or unbounded memory. The kept crashers in tests/fuzz_corpus/ are replayed.
``PREFIXCACHE_FUZZ_EXAMPLES`` scales the examples per target (docs/robustness.md has the longer,
coverage-guided run with atheris).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_targets import corpus, targets

SCALE = int(os.environ.get("PREFIXCACHE_FUZZ_EXAMPLES", "12")) / 12
# loading a model is slower than parsing a TOML file: fewer examples for the model files
EXAMPLES = {"gguf": 40, "safetensors": 30, "tokenizer": 40}
INTERESTING = [0, 1, 0x7F, 0xFF, 0x7FFF_FFFF, 0xFFFF_FFFF, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]
TEXT_NUMBERS = [b"-1", b"0", b"1e999", b"NaN", b"99999999999999999999999", b"-0.0", b"1e-400",
                b"\"\"", b"null", b"[]", b"{}", b"true"]
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]


@st.composite
def mutated(draw: st.DrawFn, seeds: tuple[bytes, ...]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "insert", "integer", "number",
                                     "duplicate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "integer":  # a binary count, length or offset made extreme
            width = draw(st.sampled_from([4, 8]))
            value = draw(st.sampled_from(INTERESTING)) & ((1 << (8 * width)) - 1)
            data[at:at + width] = value.to_bytes(width, "little")
        elif kind == "number":  # a text value replaced by an extreme or mistyped one
            end = at + draw(st.integers(0, 8))
            data[at:end] = draw(st.sampled_from(TEXT_NUMBERS))
        elif kind == "duplicate":  # a stretch repeated: nesting, repeated keys
            end = min(len(data), at + draw(st.integers(1, 64)))
            data[at:at] = data[at:end] * draw(st.integers(2, 8))
    return bytes(data)


def _settings(name: str) -> settings:
    return settings(max_examples=max(1, round(EXAMPLES.get(name, 150) * SCALE)), deadline=None,
                    database=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("name", list(targets()))
def test_mutated_files_are_read_or_refused_by_name(name: str) -> None:
    target = targets()[name]
    seeds = tuple(target.seeds())
    for seed in seeds:
        target.check(seed)  # the seeds themselves are valid

    @given(mutated(seeds))
    @_settings(name)
    def fuzz(data: bytes) -> None:
        target.check(data)

    fuzz()


@pytest.mark.parametrize("name", list(targets()))
def test_arbitrary_bytes_are_refused_by_name(name: str) -> None:
    target = targets()[name]

    @given(st.binary(max_size=512))
    @settings(max_examples=max(1, round(30 * SCALE)), deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(data: bytes) -> None:
        target.check(data)

    fuzz()


@pytest.mark.parametrize(
    "case", [pytest.param((name, path), id=f"{name}/{path.name}")
             for name in targets() for path in corpus(name)])
def test_kept_crashers_stay_fixed(case) -> None:
    name, path = case
    targets()[name].check(path.read_bytes())
