"""`AsyncEngine`: the single-threaded `LLMEngine` driven from a background thread for asyncio.

The engine thread owns the engine. The event loop hands it commands (add, abort, reset) through a
locked queue and awaits their results as futures; the thread runs them between steps, steps while
any request is unfinished, and delivers each step's incremental outputs to the per-request
asyncio queues with ``loop.call_soon_threadsafe``. Admission control (the 429 limit) is counted on
the event loop side. Nothing here knows about HTTP or the OpenAI format.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from prefixcache.errors import describe_exception
from prefixcache.model.host_memory import TRIM_INTERVAL_S, FreedMemoryTrimmer
from prefixcache.server.metrics import EngineSnapshot, ServerMetrics
from prefixcache.server.protocol import JSONObject

if TYPE_CHECKING:
    from prefixcache.cache import CacheIdentity, KVCacheEvent
    from prefixcache.cache.fates import Fate
    from prefixcache.engine.input_processor import InputProcessor
    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.lora import LoraRegistry
    from prefixcache.engine.outputs import EngineLimits, RequestOutput
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.engine.structured import GrammarCompiler
    from prefixcache.model.tokenizer import Tokenizer

    OutputQueue = asyncio.Queue[RequestOutput | "EngineFailure"]

__all__ = ["AsyncEngine", "EngineFailure", "EngineOverloaded"]

logger = logging.getLogger("prefixcache.server")
T = TypeVar("T")


class EngineOverloaded(Exception):
    """The request queue is full: answer 429 and let the client retry later."""


class EngineFailure(Exception):
    """The engine failed while running a step; the request it carried was dropped."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: OutputQueue


class AsyncEngine:
    """Runs ``engine.step()`` in a thread while work is pending; outputs go to asyncio queues.

    ``max_pending`` bounds the requests accepted and not yet finished (running + waiting), and
    ``max_pending_per_domain`` those of one isolation domain; one more gets `EngineOverloaded`.
    Between steps, and once after the last step of a burst, freed memory goes back to the OS at
    most every ``trim_interval_s`` (`FreedMemoryTrimmer`).
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_pending: int,
        metrics: ServerMetrics | None = None,
        log_interval_s: float = 10.0,
        max_pending_per_domain: int | None = None,
        trim_interval_s: float = TRIM_INTERVAL_S,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        # one domain (tenant or group) may not fill the whole queue: others could only get 429
        self.max_pending_per_domain = max_pending_per_domain or max_pending
        self._pending_by_domain: dict[str, int] = {}  # event-loop side only
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self.snapshot = engine.snapshot()  # gauges read true levels before any step
        if metrics is not None:
            metrics.update(self.snapshot)
        self.num_pending = 0  # event-loop side only
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._log = _PeriodicLog(log_interval_s)
        # a server retains freed memory: hand it back
        self._trimmer = FreedMemoryTrimmer(trim_interval_s)
        # called on the engine thread with the KV events of each step or command that made any
        self.kv_event_sink: Callable[[list[KVCacheEvent]], None] | None = None
        self.on_stop: list[Callable[[], None]] = []  # after the engine thread has ended

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prefixcache-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for callback in self.on_stop:
            callback()
        self.on_stop.clear()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- what the server and the cluster read of the engine (fixed at construction) ----------

    @property
    def limits(self) -> EngineLimits:
        """What the engine accepts (context length, vocabulary, sequences, KV blocks)."""
        return self.engine.limits

    @property
    def inputs(self) -> InputProcessor:
        """The engine's request checks (stateless: safe off the engine thread)."""
        return self.engine.inputs

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (thread-safe to call from the event loop's workers)."""
        return self.engine.tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's output-grammar compiler and cache (compile off the loop, before add)."""
        return self.engine.grammars

    @property
    def loras(self) -> LoraRegistry | None:
        """The engine's LoRA adapters (names are read from any thread; loads go through
        `call`), None with LoRA off."""
        return self.engine.loras

    @property
    def cache_identity(self) -> CacheIdentity:
        """What names the engine's cache blocks (a cluster ingress digests prompts with it)."""
        return self.engine.cache_identity

    def block_fate(self, digest: bytes, domain: str, since: float) -> Fate | None:
        """Why ``domain``'s block ``digest`` left the cache after ``since`` (diagnostics)."""
        return self.engine.block_fate(digest, domain, since)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block between steps; False while requests hold blocks."""
        return await self.call(self.engine.reset_prefix_cache)

    async def pins_of(self, domain: str) -> list[JSONObject]:
        """``domain``'s pins as plain data (digests and counts, never tokens or text)."""
        return await self.call(lambda: self.engine.pins_of(domain))

    async def release_pin(self, domain: str, pin_id: str) -> bool:
        """Release ``domain``'s pin ``pin_id`` (False: no such pin of that domain)."""
        return await self.call(lambda: self.engine.release_pin(pin_id, domain))

    async def reset_prefix_cache_and_pins(self) -> tuple[bool, int]:
        """`reset_prefix_cache`, and how many pins the reset released."""
        def reset() -> tuple[bool, int]:
            done = self.engine.reset_prefix_cache()
            return done, self.engine.num_pins_released_by_reset

        return await self.call(reset)

    async def purge_domain(self, domain: str) -> dict[str, int]:
        """Remove ``domain``'s free cached blocks from RAM (between steps), then its blocks
        from the lower tiers (off the engine thread: the tiers are thread-safe and a purge walks
        the disk). Blocks removed per tier, ``ram`` first."""
        removed = {"ram": await self.call(lambda: self.engine.drop_domain(domain))}
        removed.update(await asyncio.to_thread(self.engine.purge_domain, domain))
        return removed

    # ---- event-loop API -------------------------------------------------------------------------

    async def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        salt: str | None, use_cache: bool, domain: str = "", queue: OutputQueue | None = None,
        pins: list[tuple[int, float]] | None = None, lora: str | None = None,
        public_blocks: int = 0,
    ) -> OutputQueue:
        """Queue a request; its outputs arrive on the returned queue (``queue``, which several
        requests may share, or a new one), the last one with ``request_finished``. ``lora``:
        the name of the LoRA adapter it runs under. Raises ValueError (bad request;
        `LoraNotFound`: no adapter of that name now) or `EngineOverloaded` (the server's limit,
        or ``domain``'s own share of it, is reached)."""
        if self._pending_by_domain.get(domain, 0) >= self.max_pending_per_domain:
            raise EngineOverloaded(
                f"this caller has {self.max_pending_per_domain} queued and running requests, "
                "its limit; retry later"
            )
        if self.num_pending >= self.max_pending:
            raise EngineOverloaded(
                f"the server is at its limit of {self.max_pending} queued and running requests; "
                "retry later"
            )
        if queue is None:
            queue = asyncio.Queue()
        stream = _Stream(asyncio.get_running_loop(), queue)

        def add_in_thread() -> None:
            self.engine.add_request(request_id, None, params, prompt_token_ids=prompt_token_ids,
                                    cache_salt=salt, use_cache=use_cache, domain=domain,
                                    pins=pins or (), lora_request=lora,
                                    public_blocks=public_blocks)
            self._streams[request_id] = stream

        self._count(domain, +1)
        try:
            await self.call(add_in_thread)
        except BaseException:
            self._count(domain, -1)
            raise
        return stream.queue

    def release(self, domain: str = "") -> None:
        """The caller is done with a request added by `add` (finished or aborted)."""
        self._count(domain, -1)

    def _count(self, domain: str, delta: int) -> None:
        self.num_pending += delta
        left = self._pending_by_domain.get(domain, 0) + delta
        if left > 0:
            self._pending_by_domain[domain] = left
        else:
            self._pending_by_domain.pop(domain, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once finished); fire and forget, thread safe."""
        self._submit(lambda: self._abort_in_thread(request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                future.set_exception(exc)

        self._submit(run)
        return await asyncio.wrap_future(future)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            commands = self._next_commands()
            if commands is None:
                break
            for command in commands:
                command()
            if self.engine.has_unfinished():
                self._step()
            self._drain_kv_events()
            self._log.maybe_log(self.snapshot)
            self._trimmer.maybe_trim()
        self._fail_all("the server is shutting down")

    def _drain_kv_events(self) -> None:
        if self.kv_event_sink is None:
            return
        events = self.engine.take_kv_events()
        if events:
            try:
                self.kv_event_sink(events)
            except Exception as exc:  # noqa: BLE001 - a publisher fault must not stop serving
                logger.error("KV event publishing failed: %s", describe_exception(exc))

    def _next_commands(self) -> list[Callable[[], None]] | None:
        """Pending commands; blocks while there is neither a command nor engine work."""
        with self._wakeup:
            while not (self._commands or self._stopping or self.engine.has_unfinished()):
                # idle: wake for the next log line, or for the trim of what the last burst freed
                # once it is due (so an idle server's RSS is what it holds, not its last step's)
                due = self._trimmer.seconds_until_due()
                self._wakeup.wait(self.log_interval_s if due is None
                                  else min(self.log_interval_s, due + 0.01))
                self._log.maybe_log(self.snapshot)
                self._trimmer.maybe_trim()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.error("engine step failed: %s; failing its requests", describe_exception(exc))
            self._fail_all(f"the engine failed while running this request ({type(exc).__name__})")
            return
        self._trimmer.note_work()
        self._deliver(outputs)
        self.snapshot = self.engine.snapshot()
        if self.metrics is not None:
            self.metrics.update(self.snapshot)
        self._log.count(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputQueue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
            if output.request_finished:
                del self._streams[output.request_id]
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _abort_in_thread(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            self._streams.pop(request_id, None)

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already broken; keep failing
                pass
            _call_soon(stream.loop, stream.queue.put_nowait, EngineFailure(message))
        try:
            if self.engine.has_unfinished():
                self.engine.step()  # collect the abort outputs so the engine is idle again
        except Exception:  # noqa: BLE001 - already reported by the caller
            pass


def _put_all(items: list[tuple[OutputQueue, RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], arg: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


class _PeriodicLog:
    """Every ``interval_s`` with activity: running/waiting, KV usage, hit rate, token rate."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last = EngineSnapshot()
        self._num_tokens = 0

    def count(self, outputs: list[RequestOutput]) -> None:
        self._num_tokens += sum(len(o.new_token_ids) for o in outputs)

    def maybe_log(self, snap: EngineSnapshot) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        queried = snap.queried_tokens - self._last.queried_tokens
        if self._num_tokens or queried or snap.num_running or snap.num_waiting:
            hits = snap.hit_tokens - self._last.hit_tokens
            logger.info(
                "running=%d waiting=%d kv_usage=%.1f%% prefix_hit_rate=%.1f%% (total %.1f%%) "
                "generation=%.1f tok/s",
                snap.num_running, snap.num_waiting, 100 * snap.kv_cache_usage,
                100 * hits / queried if queried else 0.0, 100 * snap.hit_rate,
                self._num_tokens / elapsed,
            )
        self._last_time, self._last, self._num_tokens = now, snap, 0
