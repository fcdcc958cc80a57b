"""Trace readers, the recorded-traffic format, synthetic generators and the ideal hit ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.cache import BlockHasher, Namespace
from prefixcache.sim.agentic import read_agentic
from prefixcache.sim.errors import TraceFormatError
from prefixcache.sim.loader import detect_format, load_trace
from prefixcache.sim.mooncake import read_mooncake
from prefixcache.sim.record import TraceRecorder, read_record
from prefixcache.sim.report import ideal_hit_ratio
from prefixcache.sim.synthetic import GENERATORS, BlockIds, generate
from prefixcache.sim.tokens import TokenSource

FIXTURES = Path(__file__).parent / "fixtures"
CONVERSATION = FIXTURES / "mooncake_conversation_300.jsonl"


def test_mooncake_reader_fields_and_units() -> None:
    trace = read_mooncake(CONVERSATION)
    assert len(trace) == 300 and trace.block_size == 512
    first = json.loads(CONVERSATION.read_text().splitlines()[0])
    assert trace.requests[0].hash_ids == first["hash_ids"]
    assert trace.requests[0].input_length == first["input_length"]
    last_ms = max(json.loads(line)["timestamp"] for line in CONVERSATION.read_text().splitlines())
    assert trace.requests[-1].arrival_s == pytest.approx(last_ms / 1000)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ],
)
def test_mooncake_reader_names_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}'
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=rf"t.jsonl:2: .*{message}"):
        read_mooncake(path)


def test_missing_trace_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(str(tmp_path / "nope.jsonl"))


def test_agentic_reader_flattens_subagents_with_absolute_times() -> None:
    path = FIXTURES / "agentic_trace_0010_head.json"
    raw = json.loads(path.read_text())
    trace = read_agentic(path)
    sub = raw["requests"][1]
    assert len(trace) == 3 + len(sub["requests"])
    sub_times = sorted(r.arrival_s for r in trace.requests if "agent_001" in r.request_id)
    assert sub_times == [pytest.approx(sub["t"] + r["t"]) for r in sub["requests"]]
    assert trace.block_size == 64


def test_agentic_hash_ids_from_different_conversations_never_collide() -> None:
    raw_a = json.loads((FIXTURES / "agentic_trace_0010_head.json").read_text())
    raw_b = json.loads((FIXTURES / "agentic_trace_0012_head.json").read_text())
    assert raw_a["requests"][0]["hash_ids"][0] == raw_b["requests"][0]["hash_ids"][0]
    trace = read_agentic(FIXTURES)
    ids_a = {h for r in trace.requests if r.group == "agentic_trace_0010_head" for h in r.hash_ids}
    ids_b = {h for r in trace.requests if r.group == "agentic_trace_0012_head" for h in r.hash_ids}
    assert ids_a and ids_b and not ids_a & ids_b
    assert detect_format(FIXTURES) == "agentic"


def test_record_round_trip_keeps_sharing_and_no_text(tmp_path: Path) -> None:
    hasher = BlockHasher(4)
    prompts = [list(range(10)), list(range(8)) + [90, 91, 92, 93], list(range(13))]
    path = tmp_path / "rec.jsonl"
    with TraceRecorder(path, block_size=4, clock=iter([0.0, 1.0, 2.0, 3.0]).__next__) as rec:
        for prompt in prompts:
            rec.record(len(prompt), 3, hasher.chain(prompt, Namespace()), cached_tokens=0)
    assert detect_format(path) == "record"
    trace = read_record(path)
    assert [r.input_length for r in trace.requests] == [10, 12, 13]
    assert [r.arrival_s for r in trace.requests] == [1.0, 2.0, 3.0]
    a, b, c = (r.hash_ids for r in trace.requests)
    assert a == b[:2] == c[:2] and b[2] != c[2] and len(set(a + b + c)) == 4
    body = json.loads(path.read_text().splitlines()[1])
    assert set(body) == {"t", "input_length", "output_length", "cached_tokens", "block_digests"}


def test_record_reader_rejects_a_foreign_header(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"format": "other", "version": 1}\n')
    with pytest.raises(TraceFormatError, match="header"):
        read_record(path)


def test_block_ids_share_exactly_the_common_token_stream() -> None:
    ids = BlockIds(4)
    a = ids.hash_ids([("sys", 10), ("q1", 6)])
    b = ids.hash_ids([("sys", 10), ("q2", 6)])
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2] and a[2] != b[2]  # block 2 mixes the system tail with the question


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_and_share_prefixes(name: str) -> None:
    small = "seed=3"
    first, second = generate(name, small), generate(name, small)
    assert [(r.arrival_s, r.hash_ids) for r in first.requests] == [
        (r.arrival_s, r.hash_ids) for r in second.requests
    ]
    # pinned-prompt's flood shares nothing by design: only its one system prompt repeats
    assert (0.05 if name == "pinned-prompt" else 0.2) < ideal_hit_ratio(first) < 1.0
    times = [r.arrival_s for r in first.requests]
    assert times == sorted(times)


def test_generator_parameters_are_typed_and_checked() -> None:
    trace = generate("multi-turn", "num_conversations=2,turns=3,think_time_s=1.5")
    assert len(trace) == 6
    with pytest.raises(TraceFormatError, match="known"):
        generate("multi-turn", "bogus=1")
    with pytest.raises(TraceFormatError, match="unknown synthetic"):
        generate("nope")


def test_tokens_follow_hash_ids_and_tails_are_unique() -> None:
    trace = read_mooncake(CONVERSATION).head(20)
    source = TokenSource(trace)
    a, b = trace.requests[0], trace.requests[1]
    ta, tb = source.prompt(a), source.prompt(b)
    assert len(ta) == a.input_length and ta[:512] == list(range(512))
    assert ta[:512] == tb[:512]  # both start with hash id 0
    tail_a = set(ta[a.num_full_blocks(512) * 512 :])
    tail_b = set(tb[b.num_full_blocks(512) * 512 :])
    assert tail_a and not tail_a & tail_b and min(tail_a) > trace.max_hash_id * 512


def test_ideal_hit_ratio_matches_a_direct_count() -> None:
    trace = read_mooncake(CONVERSATION)
    seen: set[int] = set()
    hit = total = 0
    for r in trace.requests:
        n = 0
        while n < (r.input_length - 1) // 512 and r.hash_ids[n] in seen:
            n += 1
        hit, total = hit + 512 * n, total + r.input_length
        seen.update(r.hash_ids[: r.input_length // 512])
    assert ideal_hit_ratio(trace) == pytest.approx(hit / total)
    assert ideal_hit_ratio(trace) > 0.05


LMBENCH = FIXTURES / "lmbench_shape_24.jsonl"  # LMCache's LMBench shape, made up for the test


def test_lmbench_shape_reads_with_ns_string_times_and_32_bit_hash_ids() -> None:
    rows = [json.loads(line) for line in LMBENCH.read_text().splitlines()]
    assert isinstance(rows[0]["timestamp"], str) and max(max(r["hash_ids"]) for r in rows) > 2**31
    trace = load_trace(str(LMBENCH), block_size=32)
    assert len(trace) == 24 and trace.requests[0].arrival_s == 0.0
    times = [int(r["timestamp"]) for r in rows]
    gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:], strict=False)]
    arrivals = [r.arrival_s for r in trace.requests]
    got = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert got == pytest.approx(gaps, abs=1e-6)  # nanoseconds detected
    as_ms = load_trace(str(LMBENCH), block_size=32, time_unit="ms")
    assert as_ms.requests[-1].arrival_s == pytest.approx(1e6 * trace.requests[-1].arrival_s)


def test_large_hash_ids_are_renumbered_with_the_same_sharing(tmp_path: Path) -> None:
    trace = load_trace(str(LMBENCH), block_size=32)
    dense: dict[int, int] = {}
    small = tmp_path / "small.jsonl"
    with small.open("w") as out:
        for line in LMBENCH.read_text().splitlines():
            row = json.loads(line)
            row["hash_ids"] = [dense.setdefault(h, len(dense)) for h in row["hash_ids"]]
            out.write(json.dumps(row) + "\n")
    renumbered = load_trace(str(small), block_size=32)
    a, b = TokenSource(trace), TokenSource(renumbered)
    for x, y in zip(trace.requests, renumbered.requests, strict=True):
        assert a.prompt(x)[: 32 * len(x.hash_ids)] == b.prompt(y)[: 32 * len(y.hash_ids)]
    assert ideal_hit_ratio(trace) == ideal_hit_ratio(renumbered) > 0.3


def test_a_bad_field_names_the_file_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": "soon", "input_length": 5, "output_length": 1, '
                    '"hash_ids": []}\n')
    with pytest.raises(TraceFormatError) as info:
        load_trace(str(path))
    assert str(info.value).count(str(path)) == 1 and "'timestamp' must be a number" in str(
        info.value)
