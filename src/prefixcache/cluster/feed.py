"""Subscribing to several replicas' KV events (vLLM's ZMQ wire format) for a router's index.

Each replica publishes on its own PUB socket with its own topic (`prefixcache serve
--kv-events-config`, `server/kv_events.py`); `EventFeed` connects one SUB socket to all of them,
checks each topic's sequence numbers and, on a gap (a missed batch, or batches sent before it
connected), asks that replica's replay socket for what it missed before applying the newer one.
When a replay cannot fill the gap, ``on_lost(topic)`` tells the owner to forget that replica's
blocks (it may route a request worse, never wrongly: a replica answers a miss by computing).

The sockets live on the feed's thread; ``watch``/``forget`` may be called from any thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixcache.server.kv_events import END_SEQ, decode_batch

__all__ = ["EventFeed"]

logger = logging.getLogger("prefixcache.cluster")

_POLL_MS = 20
_REPLAY_TIMEOUT_MS = 2000


@dataclass(slots=True)
class _Source:
    endpoint: str
    replay_endpoint: str | None
    next_seq: int = 0


class EventFeed:
    """Delivers each watched topic's events in order to ``on_events(topic, events)``."""

    def __init__(
        self,
        on_events: Callable[[str, list[Any]], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._on_events = on_events
        self._on_lost = on_lost
        self._commands: queue.SimpleQueue[tuple[str, str, _Source | None]] = queue.SimpleQueue()
        self._sources: dict[str, _Source] = {}  # feed thread only
        self._stop = threading.Event()
        self.num_replays = 0
        self.num_lost = 0
        self._thread = threading.Thread(target=self._run, name="prefixcache-event-feed",
                                        daemon=True)
        self._thread.start()

    def watch(self, topic: str, endpoint: str, replay_endpoint: str | None) -> None:
        self._commands.put(("watch", topic, _Source(endpoint, replay_endpoint)))

    def forget(self, topic: str) -> None:
        self._commands.put(("forget", topic, None))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # ---- the feed thread -----------------------------------------------------------------------

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            while not self._stop.is_set():
                self._apply_commands(sub)
                if not sub.poll(_POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) == 3:
                    self._receive(context, *frames)
        except Exception:  # the router keeps routing by load without an index
            logger.exception("KV event feed stopped")
        finally:
            sub.close(0)
            context.term()

    def _apply_commands(self, sub: Any) -> None:
        while True:
            try:
                kind, topic, source = self._commands.get_nowait()
            except queue.Empty:
                return
            old = self._sources.pop(topic, None)
            if old is not None:
                sub.disconnect(old.endpoint)
            if kind == "watch" and source is not None:
                self._sources[topic] = source
                sub.connect(source.endpoint)

    def _receive(self, context: Any, topic_bytes: bytes, seq_bytes: bytes, payload: bytes) -> None:
        topic = topic_bytes.decode(errors="replace")
        source = self._sources.get(topic)
        if source is None:
            return  # a replica no longer watched
        seq = int.from_bytes(seq_bytes, "big")
        if seq < source.next_seq:
            return  # already applied through a replay
        if seq > source.next_seq and not self._replay(context, topic, source, seq):
            self.num_lost += 1
            self._on_lost(topic)
        self._deliver(topic, source, seq, payload)

    def _deliver(self, topic: str, source: _Source, seq: int, payload: bytes) -> None:
        source.next_seq = seq + 1
        try:
            _, events = decode_batch(payload)
        except ValueError:
            logger.warning("KV events: an undecodable batch from a replica; ignored")
            return
        self._on_events(topic, events)

    def _replay(self, context: Any, topic: str, source: _Source, until: int) -> bool:
        """Apply batches ``source.next_seq`` .. ``until - 1`` from the replica's replay socket;
        False when they cannot all be had."""
        import zmq

        if source.replay_endpoint is None:
            return False
        self.num_replays += 1
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, _REPLAY_TIMEOUT_MS)
        try:
            dealer.connect(source.replay_endpoint)
            dealer.send_multipart((b"", source.next_seq.to_bytes(8, "big")))
            while True:
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if source.next_seq <= seq < until:
                    if seq != source.next_seq:
                        return False  # the replay buffer no longer holds the start
                    self._deliver(topic, source, seq, frames[3])
        except zmq.ZMQError:
            return False
        finally:
            dealer.close(0)
        return source.next_seq == until
