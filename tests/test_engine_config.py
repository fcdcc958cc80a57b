"""`EngineConfig`: built once from keywords or flags, validated, passed down unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from prefixcache.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from prefixcache.engine.config import add_engine_arguments
from prefixcache.sched.fairness import DomainLimits


def test_flat_keywords_land_in_their_parts() -> None:
    config = EngineConfig.from_kwargs(
        "tiny", block_size=8, num_kv_blocks=40, prefix_cache="radix", eviction_policy="lfu",
        enable_prefix_caching=False, max_num_seqs=3, schedule_policy="lpm", dedup=False,
        seed=5, default_domain_limits=DomainLimits(max_seqs=2),
    )  # fmt: skip
    assert (config.cache.kind, config.cache.block_size, config.cache.num_blocks) == ("radix", 8, 40)
    assert config.cache.eviction_policy == "lfu" and not config.cache.enable_prefix_caching
    assert not config.cache.enable_kv_events  # an engine keeps no events without a consumer
    assert (config.scheduler.max_num_seqs, config.scheduler.schedule_policy) == (3, "lpm")
    assert not config.scheduler.dedup and config.scheduler.default_domain_limits.max_seqs == 2
    assert config.seed == 5 and config.model == "tiny"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"block_size": 0}, ValueError),
        ({"schedule_policy": "sjf"}, ValueError),
        ({"eviction_policy": "lfu"}, ValueError),  # hash has no lfu
        ({"dtype": "int4"}, ValueError),
        ({"max_num_seq": 4}, TypeError),  # a misspelled setting is named, not ignored
    ],
)
def test_bad_settings_are_refused_before_any_model_loads(
    settings: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        EngineConfig.from_kwargs("no-such-model", **settings)


def test_removed_spellings_are_named_not_ignored() -> None:
    for old in ("policy", "zero_freed_blocks"):
        with pytest.raises(TypeError, match=old):
            EngineConfig.from_kwargs(**{old: True})


def test_the_engine_is_built_from_its_config() -> None:
    config = EngineConfig.from_kwargs("tiny", block_size=8, num_kv_blocks=32, max_num_seqs=2)
    engine = LLMEngine(config=config)
    assert engine.engine_config is config
    assert engine.cache.config.num_blocks == 32 and engine.cache.config.model_id
    assert engine.scheduler.config is config.scheduler
    with pytest.raises(TypeError, match="not both"):
        LLMEngine(config=config, block_size=16)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    by_config = LLM(config=config).generate(["the same prompt"] * 2, params)
    by_keywords = LLM("tiny", block_size=8, num_kv_blocks=32, max_num_seqs=2).generate(
        ["the same prompt"] * 2, params
    )
    assert [o.token_ids for o in by_config] == [o.token_ids for o in by_keywords]
    assert by_config[1].num_cached_tokens == by_keywords[1].num_cached_tokens > 0


def test_cli_flags_build_the_same_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        ["--prefix-cache", "radix", "--eviction-policy", "lfu", "--schedule-policy", "lpm",
         "--block-size", "8", "--zero-on-reuse"]
    )  # fmt: skip
    config = EngineConfig.from_args(args)
    assert config == EngineConfig.from_kwargs(
        "tiny", prefix_cache="radix", eviction_policy="lfu", schedule_policy="lpm", block_size=8,
        zero_on_reuse=True, dtype="auto",  # the commands measure; the library runs float32
    )  # fmt: skip
    with pytest.raises(SystemExit):  # one spelling a flag: the old aliases are gone
        parser.parse_args(["--policy", "lpm"])


def test_a_library_engine_leaves_the_process_malloc_alone() -> None:
    code = (
        "from prefixcache.engine import LLMEngine\n"
        "from prefixcache.model.host_memory import retain_freed_memory\n"
        "LLMEngine('tiny', num_kv_blocks=8)\n"
        "print(retain_freed_memory.cache_info().currsize)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"  # never called: only `prefixcache serve` opts in


@pytest.mark.parametrize(("flags", "tuned"), [([], "1"), (["--no-retain-freed-memory"], "0")])
def test_the_server_opts_in_to_keeping_freed_memory(flags: list[str], tuned: str) -> None:
    code = (
        "import argparse, sys\n"
        "from prefixcache.server.cli import add_arguments, build_app\n"
        "from prefixcache.model.host_memory import retain_freed_memory\n"
        "parser = argparse.ArgumentParser(); add_arguments(parser)\n"
        "build_app(parser.parse_args(['--num-kv-blocks', '8', *sys.argv[1:]]))\n"
        "print(retain_freed_memory.cache_info().currsize)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *flags], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == tuned


def test_kv_cache_space_flag_sizes_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for text, expected in (("4G", 4 << 30), ("512MiB", 512 << 20), ("1048576", 1 << 20)):
        args = parser.parse_args(["--kv-cache-memory-bytes", text])
        assert EngineConfig.from_args(args).kv_cache_memory_bytes == expected
    assert EngineConfig.from_args(parser.parse_args([])).kv_cache_memory_bytes == 256 << 20
    small = EngineConfig.from_args(parser.parse_args(["--kv-cache-memory-bytes", "64K"]))
    assert LLMEngine(config=small).limits.num_kv_blocks < LLMEngine(config=dataclasses.replace(
        small, kv_cache_memory_bytes=1 << 20)).limits.num_kv_blocks
    for bad in ("0", "-1G", "lots", "inf", ""):
        with pytest.raises(SystemExit):
            parser.parse_args([f"--kv-cache-memory-bytes={bad}"])
        assert "not a size in bytes" in capsys.readouterr().err


def test_a_valkey_ttl_under_a_second_is_refused() -> None:
    from prefixcache.tiers import TierConfig

    url = "redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError, match="kv-valkey-ttl"):
        TierConfig({"kv_valkey": url, "kv_valkey_ttl": 0})
    assert TierConfig({"kv_valkey": url, "kv_valkey_ttl": 1}).settings["kv_valkey_ttl"] == 1
    with pytest.raises(TypeError, match="kv_valkey_ttl_s"):  # a setting is its flag's name
        TierConfig({"kv_valkey_ttl_s": 1})
