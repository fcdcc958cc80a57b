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


def start_server(argv: list[str]) -> RunningServer:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    app = build_app(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
