"""A bounded walk over a GGUF file's header before the `gguf` library reads it.

The library trusts the counts it reads: an array claiming 2^64 items, each read past the end of
the file as zero bytes, keeps it looping forever, and a huge string length or tensor count makes
it allocate or iterate without end. This walk reads the same header (magic, version, metadata
key/values, tensor infos) with every length and count checked against the bytes that are left,
so a damaged or hostile file is refused with a `GGUFError` naming the file, the field and the
offset, in time proportional to the file's size. The format: llama.cpp's ``docs/gguf.md``.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

__all__ = ["GGUFError", "check_gguf_layout"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays (none of the files the runtime reads nests deeper)
# GGUF value types: fixed-size scalars by size in bytes; 8 is a string, 9 an array
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MIN_KV_BYTES = 8 + 4  # a key's length and a value type, at least
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, dims count, type, offset
_MIN_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata count


class GGUFError(ValueError):
    """A GGUF file this runtime cannot serve, naming what it does not support."""


class _Walk:
    """A cursor over the file's bytes that refuses to step past their end."""

    def __init__(self, data: bytes | mmap.mmap, path: Path, order: str) -> None:
        self.data, self.path, self.order, self.pos = data, path, order, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"cannot read GGUF file {self.path}: {what} (offset {self.pos})")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def skip(self, size: int, what: str) -> None:
        if size > self.left:
            raise self.fail(f"{what} needs {size} bytes, {self.left} are left")
        self.pos += size

    def uint(self, size: int, what: str) -> int:
        start = self.pos
        self.skip(size, what)
        code = {4: "I", 8: "Q"}[size]
        return int(struct.unpack_from(self.order + code, self.data, start)[0])

    def string(self, what: str) -> None:
        self.skip(self.uint(8, f"{what}'s length"), what)

    def value(self, value_type: int, what: str, depth: int = 0) -> None:
        if value_type in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[value_type], what)
        elif value_type == _STRING:
            self.string(what)
        elif value_type == _ARRAY and depth < MAX_NESTING:
            self.array(what, depth)
        else:
            raise self.fail(f"{what} has value type {value_type}, which GGUF does not define")

    def array(self, what: str, depth: int) -> None:
        item_type = self.uint(4, f"{what}'s item type")
        count = self.uint(8, f"{what}'s item count")
        if item_type in _SCALAR_SIZES:
            self.skip(count * _SCALAR_SIZES[item_type], f"{what}'s {count} items")
            return
        if count * 8 > self.left:  # a string or an array takes 8 bytes at least
            raise self.fail(f"{what} claims {count} items, more than the file holds")
        for _ in range(count):
            self.value(item_type, f"an item of {what}", depth + 1)


def check_gguf_layout(path: Path) -> None:
    """Refuse a file whose header the `gguf` reader could not walk in bounded time and memory."""
    size = path.stat().st_size
    if size < _MIN_HEADER_BYTES:
        raise GGUFError(f"cannot read GGUF file {path}: {size} bytes, too short for a header")
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _walk_header(data, path)


def _walk_header(data: mmap.mmap, path: Path) -> None:
    walk = _Walk(data, path, "<")
    walk.skip(4, "the magic number")
    if data[:4] != MAGIC:
        raise walk.fail(f"not a GGUF file (magic {bytes(data[:4])!r})")
    version = walk.uint(4, "the version")
    if version & 0xFFFF == 0:  # written big-endian
        walk.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in VERSIONS:
        raise walk.fail(f"GGUF version {version} (this reader knows {VERSIONS})")
    num_tensors = walk.uint(8, "the tensor count")
    num_kv = walk.uint(8, "the metadata count")
    if num_kv * _MIN_KV_BYTES + num_tensors * _MIN_TENSOR_BYTES > walk.left:
        raise walk.fail(f"{num_kv} metadata entries and {num_tensors} tensors claimed, more "
                        "than the file holds")
    for i in range(num_kv):
        walk.string(f"metadata key {i}")
        walk.value(walk.uint(4, f"metadata entry {i}'s type"), f"metadata entry {i}")
    for i in range(num_tensors):
        walk.string(f"tensor {i}'s name")
        num_dims = walk.uint(4, f"tensor {i}'s dimension count")
        if num_dims > MAX_DIMS:
            raise walk.fail(f"tensor {i} has {num_dims} dimensions (at most {MAX_DIMS})")
        walk.skip(8 * num_dims + 4 + 8, f"tensor {i}'s shape, type and offset")
