"""`prefixcache stress`: the real engine on a tiny KV pool, with every invariant checked each step.

Long and short requests drawn from a few shared prefixes arrive at random; some sample ``n > 1``
choices (fork, copy-on-write), some are aborted mid-flight, and the pool is so small that requests
are preempted and cached blocks evicted all the time. After every step and abort the cache's
`check_integrity()` runs, plus an independent check of the running block tables. The first broken
invariant stops the run (exit status 1) with the seed and step needed to replay it.

This module drives the engine through its public API only; it knows nothing about cache internals.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prefixcache.catalog import model_help
from prefixcache.errors import CliError

__all__ = ["StressConfig", "StressReport", "add_arguments", "run", "run_stress"]

NUM_FAMILIES = 3  # shared prefixes that requests draw from
MAX_IN_FLIGHT = 6


@dataclass(frozen=True, slots=True)
class StressConfig:
    """What to stress, for how long."""

    num_kv_blocks: int = 8
    seconds: float = 30.0
    prefix_cache: str = "hash"
    seed: int = 0
    block_size: int = 16
    model: str = "tiny"

    def __post_init__(self) -> None:
        if self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.seconds > 0:
            raise ValueError(f"seconds must be > 0, got {self.seconds}")

    @property
    def capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(slots=True)
class StressReport:
    """Counters of one run; ``violation`` names the first broken invariant (None: clean)."""

    steps: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    aborts: int = 0
    forks: int = 0
    tokens_generated: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0
    integrity_checks: int = 0
    seconds: float = 0.0
    violation: str | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def operations(self) -> int:
        return self.steps + self.requests_added + self.aborts


class _Driver:
    """Random workload generator and step loop over one engine."""

    def __init__(self, config: StressConfig) -> None:
        from prefixcache.engine.llm_engine import LLMEngine

        self.config = config
        self.rng = random.Random(config.seed)
        self.engine = LLMEngine(
            config.model,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            prefix_cache=config.prefix_cache,
            max_num_batched_tokens=4 * config.block_size,
            seed=config.seed,
            check_integrity=True,  # the engine checks after each step and abort
        )
        vocab = self.engine.model_config.vocab_size
        self.families = [
            [self.rng.randrange(vocab) for _ in range(config.capacity_tokens)]
            for _ in range(NUM_FAMILIES)
        ]
        self.live: list[str] = []
        self.report = StressReport(seed=config.seed)

    def _prompt(self, long: bool) -> list[int]:
        cap = self.config.capacity_tokens
        family = self.rng.choice(self.families)
        share = self.rng.randrange(cap // 2) if long else self.rng.randrange(cap // 8 + 1)
        length = (
            self.rng.randrange(cap // 2, 3 * cap // 4)
            if long
            else self.rng.randrange(2, cap // 8 + 3)
        )
        tail = [self.rng.randrange(len(family)) % 256 for _ in range(max(length - share, 1))]
        return family[:share] + tail

    def _add(self) -> None:
        from prefixcache.engine.sampling_params import SamplingParams

        long = self.rng.random() < 0.4
        prompt = self._prompt(long)
        room = self.config.capacity_tokens - len(prompt)
        n = self.rng.choice((1, 1, 1, 2, 3))
        max_tokens = max(1, min(self.rng.randrange(1, 24), room // n - 1))
        temperature = 0.0 if n == 1 and self.rng.random() < 0.5 else 0.9
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, seed=1)
        request_id = f"r{self.report.requests_added}"
        self.engine.add_request(request_id, prompt_token_ids=prompt, sampling_params=params)
        self.live.append(request_id)
        self.report.requests_added += 1
        self.report.forks += n - 1

    def _abort(self) -> None:
        request_id = self.live.pop(self.rng.randrange(len(self.live)))
        if self.engine.abort(request_id):
            self.report.aborts += 1
            self.report.integrity_checks += 1

    def tick(self) -> None:
        """One random operation mix followed by one engine step."""
        if len(self.live) < MAX_IN_FLIGHT and self.rng.random() < 0.5:
            self._add()
        if self.live and self.rng.random() < 0.05:
            self._abort()
        for output in self.engine.step():
            self.report.tokens_generated += len(output.new_token_ids)
            if output.request_finished and output.request_id in self.live:
                self.live.remove(output.request_id)
                self.report.requests_finished += 1
        self.report.steps += 1
        self.report.integrity_checks += 1
        check_block_tables(self.engine)

    def finish(self, start: float) -> StressReport:
        stats = self.engine.stats()
        report = self.report
        report.evictions, report.preemptions = stats["evictions"], stats["preemptions"]
        report.hit_tokens = stats["hit_tokens"]
        report.seconds = round(time.monotonic() - start, 3)
        return report


def check_block_tables(engine: Any) -> None:
    """Independent of the cache's own check: live block tables are valid and cover their KV."""
    cache = engine.inspect().cache
    for request in engine.running_requests():
        table = cache.block_table(request.seq)
        if len(set(table)) != len(table):
            raise AssertionError(f"request {request.request_id} holds a block twice: {table}")
        if any(not 0 <= b < cache.num_blocks for b in table):
            raise AssertionError(f"request {request.request_id} holds an unknown block: {table}")
        if len(table) * cache.block_size < request.seq.num_computed_tokens:
            raise AssertionError(f"request {request.request_id}'s blocks do not cover its KV")


def run_stress(
    config: StressConfig, after_step: Callable[[Any, int], None] | None = None
) -> StressReport:
    """Run until ``config.seconds`` have passed or an invariant breaks.

    ``after_step(engine, step)`` runs after each step (tests use it to inject a fault).
    """
    driver = _Driver(config)
    start = time.monotonic()
    deadline = start + config.seconds
    try:
        while time.monotonic() < deadline:
            driver.tick()
            if after_step is not None:
                after_step(driver.engine, driver.report.steps)
        _drain(driver)
    except AssertionError as exc:
        driver.report.violation = f"step {driver.report.steps}: {exc}"
    return driver.finish(start)


def _drain(driver: _Driver) -> None:
    """Abort what is left and check the pool is whole again."""
    for request_id in list(driver.live):
        driver.live.remove(request_id)
        if driver.engine.abort(request_id):
            driver.report.aborts += 1
    driver.engine.step()
    cache = driver.engine.inspect().cache
    cache.check_integrity()
    if cache.num_free_blocks != cache.num_blocks:
        raise AssertionError(f"{cache.num_blocks - cache.num_free_blocks} blocks leaked")


def format_report(report: StressReport, config: StressConfig) -> list[str]:
    status = "CLEAN" if report.violation is None else f"VIOLATION: {report.violation}"
    return [
        f"stress: {config.prefix_cache} cache, {config.num_kv_blocks} blocks of "
        f"{config.block_size} tokens, seed {config.seed}, {report.seconds:.1f} s",
        f"operations {report.operations}: steps {report.steps}, requests {report.requests_added} "
        f"(finished {report.requests_finished}, aborted {report.aborts}, forked "
        f"choices {report.forks})",
        f"tokens generated {report.tokens_generated}, hit tokens {report.hit_tokens}, "
        f"evictions {report.evictions}, preemptions {report.preemptions}, "
        f"integrity checks {report.integrity_checks}",
        status,
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-kv-blocks", type=int, default=8, help="KV pool size (8)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to run (30)")
    parser.add_argument("--prefix-cache", default="hash", help="hash | radix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model", default="tiny", help=model_help("tiny"))
    parser.add_argument("--json", action="store_true", help="also print the report as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        config = StressConfig(
            args.num_kv_blocks,
            args.seconds,
            args.prefix_cache,
            args.seed,
            args.block_size,
            args.model,
        )
        report = run_stress(config)
    except (ValueError, ImportError) as exc:
        raise CliError(str(exc)) from None
    for line in format_report(report, config):
        print(line)
    if args.json:
        print(json.dumps(asdict(report) | {"operations": report.operations}))
    return 0 if report.violation is None else 1
