"""The model-identity fingerprint that roots a cache namespace.

Covers everything that changes KV values: architecture, config.json bytes, the weight files'
content, dtype and rope settings. Weight digests are memoised per (path, size, mtime_ns), in
process and on disk under the user cache dir, so a reload costs a stat per file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from prefixcache.model.config import ModelConfig

__all__ = ["file_digest", "model_identity"]

_CHUNK = 1 << 22
_memo: dict[tuple[str, int, int], str] = {}


def model_identity(
    path: Path,
    config: ModelConfig,
    dtype: str,
    weight_files: list[Path],
    memo_dir: Path | None = None,
) -> str:
    """Hex SHA-256 over the identity fields, prefixed with the architecture for readability.

    ``path`` is a checkpoint directory (its config.json is covered) or a single-file checkpoint
    (GGUF: the configuration is inside the file, which ``weight_files`` covers).
    """
    single_file = not path.is_dir()
    fields = {
        "architecture": config.architecture,
        "config_sha256": None if single_file else file_digest(path / "config.json", memo_dir),
        # a single file is named by its content alone: a renamed copy is the same model
        "weights": {
            ("model" if single_file else f.name): file_digest(f, memo_dir)
            for f in sorted(weight_files)
        },
        "dtype": dtype,
        "rope": asdict(config.rope),
    }
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return f"{config.architecture}:{hashlib.sha256(blob).hexdigest()}"


def file_digest(path: Path, memo_dir: Path | None = None) -> str:
    """SHA-256 of a file's bytes, memoised by (resolved path, size, mtime_ns)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    digest = _memo.get(key) or _read_memo(memo_dir, key)
    if digest is None:
        digest = _sha256_file(path)
        _write_memo(memo_dir, key, digest)
    _memo[key] = digest
    return digest


def _sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _memo_file(memo_dir: Path, key: tuple[str, int, int]) -> Path:
    name = hashlib.sha256(repr(key).encode()).hexdigest()
    return memo_dir / f"{name}.sha256"


def _read_memo(memo_dir: Path | None, key: tuple[str, int, int]) -> str | None:
    if memo_dir is None:
        return None
    try:
        text = _memo_file(memo_dir, key).read_text().strip()
    except OSError:
        return None
    return text if len(text) == 64 else None


def _write_memo(memo_dir: Path | None, key: tuple[str, int, int], digest: str) -> None:
    if memo_dir is None:
        return
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo_dir)
        with os.fdopen(fd, "w") as handle:
            handle.write(digest)
        os.replace(tmp, _memo_file(memo_dir, key))
    except OSError:
        pass  # the memo is an optimisation; a read-only cache dir only costs a re-hash
