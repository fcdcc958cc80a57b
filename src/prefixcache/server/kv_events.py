"""KV cache events on the wire, in vLLM's format, for routers that consume them (llm-d, Dynamo,
Ray Serve's prefix-aware routers).

``prefixcache serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv"}'``
publishes, after each engine step that changed the cache, one ``KVEventBatch(ts, events,
data_parallel_rank)`` encoded with msgpack (msgspec), as vLLM 0.32 does: the batch as an array,
each event a map tagged by its ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``),
fields in vLLM's order. Each message is three ZMQ frames on a PUB socket: ``[topic, 8-byte
big-endian sequence number, payload]``. A subscriber that missed batches asks the ROUTER socket at
``replay_endpoint`` with ``[b"", start_seq (8 bytes)]`` and gets every buffered batch from there,
as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 (8 bytes, signed), b""]``.

Block hashes are our block digests (32 bytes, `docs/block-key.md`), which vLLM's
``ExternalBlockHash`` (``bytes | int``) carries as bytes: chained and namespace-rooted, so equal
digests mean equal KV within one model and cache salt and never across tenants. A chain's first
block has the namespace root as its ``parent_block_hash`` (vLLM sends None there). Every
``BlockStored`` and ``BlockRemoved`` names its ``medium``: ``"GPU"`` for the replica's KV pool
(vLLM's name for the KV cache attention reads, on every platform; the pool is in RAM here), else
the lower tier by its `TierKind.medium`: ``"DISK"`` (this replica's own) or ``"VALKEY"`` (shared:
every replica on that server can load its blocks). Token ids are tenant data: with a tenants file
they are left out unless asked for. A ``BlockStored`` also says how the block's KV is kept
(``kv_cache_dtype``: ``int8``, ``float32``, ...; an extra field, which vLLM's decoders skip): a
block of one layout is never another layout's, whatever its digest.

The sockets live on one publisher thread; the engine thread only hands it encoded batches
through a bounded queue (a batch that does not fit is dropped and counted, never blocking a step).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import msgspec

from prefixcache.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefixcache.errors import CliError

__all__ = ["POOL_MEDIUM", "KVEventsConfig", "ZmqEventPublisher", "decode_batch", "encode_batch"]

logger = logging.getLogger("prefixcache.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POOL_MEDIUM = "GPU"  # the KV pool's medium on the wire (an event's medium None in-process)
# read as the pool too: what replicas before tier-aware events sent for it
_POOL_MEDIA = frozenset({POOL_MEDIUM, "CPU"})


# ---- the wire structs (vLLM 0.32's field order) -------------------------------------------------


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    kv_cache_dtype: str | None = None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None = None


def _wire(
    event: KVCacheEvent, with_tokens: bool, kv_cache_dtype: str | None = None
) -> _BlockStored | _BlockRemoved | _AllBlocksCleared:
    if isinstance(event, BlockStored):
        return _BlockStored(list(event.block_hashes), event.parent_block_hash,
                            list(event.token_ids) if with_tokens else [], event.block_size,
                            event.lora_id, event.medium or POOL_MEDIUM, event.lora_name,
                            kv_cache_dtype)
    if isinstance(event, BlockRemoved):
        return _BlockRemoved(list(event.block_hashes), event.medium or POOL_MEDIUM)
    if isinstance(event, AllBlocksCleared):
        return _AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


def encode_batch(
    events: list[KVCacheEvent], ts: float, with_tokens: bool, rank: int | None = None,
    kv_cache_dtype: str | None = None,
) -> bytes:
    """One ``KVEventBatch`` as vLLM's msgpack bytes (``kv_cache_dtype``: the KV layout the
    stored blocks are kept in)."""
    wire = [_wire(e, with_tokens, kv_cache_dtype) for e in events]
    return msgspec.msgpack.encode(_Batch(ts, wire, rank))


def decode_batch(payload: bytes) -> tuple[float, list[KVCacheEvent]]:
    """A ``KVEventBatch``'s timestamp and events (as `prefixcache.cache` events); raises
    ``msgspec.DecodeError`` (a ValueError) for bytes that are not one."""
    batch = msgspec.msgpack.decode(payload, type=_Batch)
    events: list[KVCacheEvent] = []
    for event in batch.events:
        if isinstance(event, _BlockStored):
            events.append(BlockStored(list(event.block_hashes), event.parent_block_hash or b"",
                                      list(event.token_ids), event.block_size,
                                      medium=_medium(event.medium), lora_id=event.lora_id,
                                      lora_name=event.lora_name))
        elif isinstance(event, _BlockRemoved):
            events.append(BlockRemoved(list(event.block_hashes), medium=_medium(event.medium)))
        else:
            events.append(AllBlocksCleared())
    return batch.ts, events


def _medium(wire: str | None) -> str | None:
    """An event's medium in-process: None for the KV pool (or no medium given)."""
    return None if wire is None or wire in _POOL_MEDIA else wire


# ---- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields (the ones that apply here)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" | "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    data_parallel_rank: int | None = None

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CliError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise CliError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CliError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: "
                           f"{', '.join(sorted(known))}")
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise CliError(f"--kv-events-config: publisher must be 'zmq' or 'null', got "
                           f"{self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CliError(f"--kv-events-config: {name} must be an integer >= 1")
        if not isinstance(self.topic, str) or not isinstance(self.endpoint, str):
            raise CliError("--kv-events-config: topic and endpoint must be strings")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# ---- the publisher ------------------------------------------------------------------------------


class ZmqEventPublisher:
    """Publishes encoded batches on a PUB socket and answers replay requests, from one thread."""

    def __init__(
        self, config: KVEventsConfig, with_tokens: bool, kv_cache_dtype: str | None = None
    ) -> None:
        import zmq

        self.config = config
        self.with_tokens = with_tokens
        self.kv_cache_dtype = kv_cache_dtype
        self.topic = config.topic.encode()
        self.num_dropped = 0
        self._next_seq = 0
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        self.replay_endpoint: str | None = None
        try:
            self._pub.bind(config.endpoint)
            # where it is bound ("tcp://host:*" picks a free port)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.close()
            raise CliError(f"--kv-events-config: cannot bind {exc}") from None
        self._thread = threading.Thread(target=self._run, name="prefixcache-kv-events",
                                        daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay %s), topic %r, token ids %s",
                    self.endpoint, self.replay_endpoint or "off", config.topic,
                    "included" if with_tokens else "left out")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (engine thread); dropped and counted if the publisher is behind."""
        if not events:
            return
        payload = encode_batch(events, time.time(), self.with_tokens,
                               self.config.data_parallel_rank, self.kv_cache_dtype)
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, payload))
        except queue.Full:
            self.num_dropped += 1

    def close(self) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(5)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._context.term()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, payload = item
            self._buffer.append(item)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:  # the socket is gone: stop quietly
                logger.warning("KV events: publishing stopped: %s", exc)
                return

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
