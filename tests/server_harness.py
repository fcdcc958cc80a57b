"""A real uvicorn server in a background thread, on a free 127.0.0.1 port, for server tests.

The app is built by ``prefixcache serve``'s own argument parser and `build_app`, so the tests
exercise the same wiring as the command line.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
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
