"""A real uvicorn server in a background thread, on a free 127.0.0.1 port, for server tests.

The app is built by ``prefixcache serve``'s own argument parser and `build_app`, so the tests
exercise the same wiring as the command line.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn

from prefixcache.server.cli import add_arguments, build_app, uvicorn_options


@dataclass
class RunningServer:
    base_url: str
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self) -> Any:
        """The `LLMEngine` (read-only inspection from tests; it runs in its own thread)."""
        return self.app.state.async_engine.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(argv: list[str], receive_buffer: int | None = None) -> RunningServer:
    """``receive_buffer``: the listening socket's SO_RCVBUF (accepted connections inherit it), to
    act out a slow or distant network on loopback."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in argv):
        # serve's default (auto) measures this CPU: the tests compare answers with in-process
        # engines, which run float32 unless told otherwise
        argv = [*argv, "--dtype", "float32"]
    args = parser.parse_args(argv)
    app = build_app(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options = {**uvicorn_options(args), "log_config": None}  # pytest captures the logs
    config = uvicorn.Config(app, log_level="warning", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread)


def wait_idle(running: RunningServer, timeout_s: float = 30.0) -> None:
    """Wait until the engine has no unfinished request (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while running.app.state.async_engine.num_pending or running.engine.has_unfinished():
        if time.monotonic() > deadline:
            raise AssertionError("the engine did not become idle")
        time.sleep(0.05)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(self.format(record))


@contextmanager
def captured_logs(*names: str) -> Iterator[list[str]]:
    """Every line the named loggers emit (at DEBUG and up) while the block runs."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    try:
        yield handler.messages
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


# ---- prompts whose greedy continuation cannot flip -------------------------------------------

# The tiny model has random weights: a prompt whose top-2 logits are closer than the float noise
# of another batch shape or of a cache hit (measured up to ~7e-5) may change its greedy tokens
# with no engine fault. Tests that compare outputs across batches or cache states use prompts
# whose every step has a top-2 margin of at least SAFE_MARGIN, found deterministically here.
SAFE_MARGIN = 1e-3
_REFERENCE: list[Any] = []


def _reference_llm() -> Any:
    if not _REFERENCE:
        from prefixcache import LLM

        _REFERENCE.append(LLM("tiny", enable_prefix_caching=False, num_kv_blocks=512))
    return _REFERENCE[0]


def tie_free_prompt(label: str, max_tokens: int, *, chat: bool = False,
                    system: str | None = None, length: int = 70) -> str:
    """A deterministic prompt text for ``label`` (unique per test, so cache hits are its own)
    whose first ``max_tokens`` greedy steps all have a clear top-2 margin; as a completion
    prompt, or as the user turn of a chat (after ``system``) when ``chat``."""
    from prefixcache import SamplingParams

    llm = _reference_llm()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for attempt in range(50):
        text = (f"[{label} #{attempt}] " + "a prefix cache keeps the keys and values. " * 10)
        text = text[:length]
        prompt: Any = text
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": text}]
            prompt = llm.chat_prompt(messages)
        out = llm.generate([prompt], params)[0]
        margins = [sorted(e["top"].values(), reverse=True) for e in out.outputs[0].logprobs]
        if all(top[0] - top[1] > SAFE_MARGIN for top in margins):
            return text
    raise AssertionError(f"no tie-free prompt for {label!r} in 50 tries")
