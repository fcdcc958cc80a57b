"""The package's compiled CPU kernels: C sources built with the system compiler at first use,
loaded with ctypes.

``attention.c`` (`prefixcache.attention.native_attention`) and ``layers.c``
(`prefixcache.model.native_layers`) sit next to this file with the header they share
(``vector_math.h``). A source is compiled once per source and header text, flags, compiler
version and CPU (``-O3 -march=native -fopenmp``: the code is tuned for the machine it runs on, so
the cache key includes /proc/cpuinfo's model and flags) into
``cache_dir()/kernels/<name>-<hash>.so``; concurrent builders race harmlessly (atomic rename).
`load_library` returns None, with a log line saying why, where there is no compiler (``$CC``,
else ``cc``) or the build fails: callers then keep their torch paths. OpenMP comes from the
libgomp torch already loaded, so the kernels share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from prefixcache.paths import cache_dir

__all__ = ["SOURCES", "Switch", "compile_flags", "cpu_signature", "load_library", "sources_digest"]

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent


class Switch:
    """A kernel family's on/off: an environment variable (``0``, ``false``, ``no``, ``off``
    turn it off for the process) and a run-time flag, for side-by-side runs. ``available`` is
    the family's build-and-probe check (looked up at each call, so tests may replace it)."""

    def __init__(self, variable: str, available: Callable[[], bool]) -> None:
        self.variable = variable
        self.available = available
        self.on = True

    def disabled_by_env(self) -> bool:
        return os.environ.get(self.variable, "1").strip().lower() in ("0", "false", "no", "off")

    def set_enabled(self, flag: bool) -> None:
        """Let callers use the kernels (default) or their torch code, process-wide."""
        self.on = bool(flag)

    def enabled(self) -> bool:
        """Whether callers use the kernels now: switched on and available."""
        return self.on and self.available()


def compile_flags() -> list[str]:
    """The kernels' compiler flags: this CPU's instruction sets, then any the user adds in
    ``PREFIXCACHE_NATIVE_CFLAGS`` (e.g. ``-mno-avx512f``: the AVX2 kernels, to measure or test
    what an AVX2-only CPU runs; part of the build's cache key like every flag)."""
    # -ffp-contract=off: a multiply and an add are fused only where the source says so
    # (vector_math.h's fmadd), never by the compiler's choice in one context and not another
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # zmm registers where the CPU has AVX-512
    return flags + shlex.split(os.environ.get("PREFIXCACHE_NATIVE_CFLAGS", ""))


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def sources_digest() -> str:
    """A digest of every kernel source and header (what a measured speed depends on)."""
    texts = [path.read_text() for path in sorted([*SOURCES.glob("*.c"), *SOURCES.glob("*.h")])]
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]


def _build(compiler: str, name: str) -> Path:
    source = SOURCES / f"{name}.c"
    flags = compile_flags()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    texts = [path.read_text() for path in [source, *sorted(SOURCES.glob("*.h"))]]
    key = hashlib.sha256(
        "\0".join([*texts, " ".join(flags), version, cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, str(source), "-o", staging],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        os.replace(staging, target)  # atomic: concurrent builders race harmlessly
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def load_library(name: str) -> ctypes.CDLL | None:
    """Build (or find in the cache) and load ``<name>.c``; None where that is not possible."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("%s kernels off: no C compiler (set CC)", name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, name)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("%s kernels off: %s", name, str(detail).strip()[:500])
        return None
