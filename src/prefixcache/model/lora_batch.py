"""Adapters in a batch: the slots of the LoRA adapters a model runs, each adapter's updates laid
out for the kernel (`prefixcache/native/lora.h`), and one step's rows by adapter.

    slots = LoraSlots(loaded.config, num_slots=4)
    slots.install(0, PackedLora.of(adapter, loaded.config))
    step = slots.step([LoraRun(row0=0, num_rows=7, slot=0)])
    logits = loaded.model(input_ids, positions, kv_cache, metadata, lora=step)

The base projections run once over every row of a step; after each, `LoraStep.apply` (or the
compiled layer calls, from the same tables) adds each adapter's low-rank update to its own rows
only: runs of rows by slot, in tiles, one kernel call per projection (S-LoRA / Punica's
segmented product). No weight is merged and no layer runs twice. A row's bits depend on its
own adapter alone (lora.h), and rows under no adapter are untouched: the base's bits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.model import native_layers
from prefixcache.model.config import ModelConfig
from prefixcache.model.lora import TARGETS, LoraAdapter, target_shape

__all__ = ["PROJECTIONS", "LoraRun", "LoraSlots", "LoraStep", "PackedLora"]

# the decoder's fused projections, in the order of a layer's tables (lora.h)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
_RANK_VECTOR = 16  # a_t's ranks padded to whole vectors (16 floats: one zmm, two ymm)
_COLS = 64  # b_t's columns padded to lora.h's LORA_COLS
MAX_RANK = 512  # lora.h's LORA_MAX_RANK

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Piece(ctypes.Structure):
    """``struct lora_piece`` of lora.h."""

    _fields_ = [("a_t", _P), ("b_t", _P), ("rank", _I), ("rank_pad", _I), ("col0", _I),
                ("n", _I), ("n_pad", _I), ("scale", _F), ("bf16w", _I)]  # fmt: skip


class _Table(ctypes.Structure):
    """``struct lora_table`` of lora.h."""

    _fields_ = [("pieces", _P), ("first", _P)]


class _Runs(ctypes.Structure):
    """``struct lora_runs`` of lora.h."""

    _fields_ = [("count", _I), ("row0", _P), ("rows", _P), ("slot", _P)]


def _columns(config: ModelConfig, name: str) -> tuple[int, int]:
    """(projection index in `PROJECTIONS`, first output column) of target ``name``."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": (0, 0), "k_proj": (0, q), "v_proj": (0, q + kv), "o_proj": (1, 0),
        "gate_proj": (2, 0), "up_proj": (2, inter), "down_proj": (3, 0),
    }[name]  # fmt: skip


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True, slots=True)
class PackedPiece:
    """One target's update in the kernel's layout: ``a_t`` [in, rank_pad] (A transposed, zero
    columns past the rank), ``b_t`` [rank, n_pad] (B transposed, zero columns past n), float32
    or bfloat16, written into output columns [col0, col0 + n)."""

    a_t: torch.Tensor
    b_t: torch.Tensor
    rank: int
    col0: int
    n: int
    scale: float

    def struct(self) -> _Piece:
        return _Piece(self.a_t.data_ptr(), self.b_t.data_ptr(), self.rank, self.a_t.shape[1],
                      self.col0, self.n, self.b_t.shape[1], self.scale,
                      int(self.a_t.dtype == torch.bfloat16))  # fmt: skip

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The update of rows ``x`` [rows, in] in float32 (the torch path, no compiler)."""
        shrunk = x.float() @ self.a_t[:, : self.rank].float()
        return (shrunk @ self.b_t[:, : self.n].float()) * self.scale


@dataclass(frozen=True, slots=True)
class PackedLora:
    """An adapter's updates for the kernel: ``pieces[layer][projection]`` (`PROJECTIONS`
    order), each a list of `PackedPiece`; ``identity`` and ``max_rank`` as the adapter's. Its
    A and B are float32, or bfloat16 for a bfloat16 model (as peft's would be there: half the
    bytes a decode step streams)."""

    identity: str
    max_rank: int
    pieces: tuple[tuple[tuple[PackedPiece, ...], ...], ...]

    @classmethod
    def of(cls, adapter: LoraAdapter, config: ModelConfig,
           dtype: torch.dtype = torch.float32) -> PackedLora:  # fmt: skip
        """Lay out ``adapter`` (checked against ``config`` by `load_adapter`) in ``dtype``
        (float32 or bfloat16)."""
        if adapter.max_rank > MAX_RANK:
            raise ValueError(f"LoRA rank {adapter.max_rank} is over the kernel's {MAX_RANK}")
        layers: list[list[list[PackedPiece]]] = [
            [[] for _ in PROJECTIONS] for _ in range(config.num_hidden_layers)
        ]
        for name in TARGETS:  # q before k before v, gate before up: column order
            for layer in range(config.num_hidden_layers):
                target = adapter.targets.get((layer, name))
                if target is None:
                    continue
                projection, col0 = _columns(config, name)
                in_features, n = target_shape(config, name)
                a_t = target.a.new_zeros(in_features, _round_up(target.rank, _RANK_VECTOR))
                a_t[:, : target.rank] = target.a.t()
                b_t = target.b.new_zeros(target.rank, _round_up(n, _COLS))
                b_t[:, :n] = target.b.t()
                piece = PackedPiece(a_t.to(dtype), b_t.to(dtype), target.rank, col0, n,
                                    target.scale)
                layers[layer][projection].append(piece)
        pieces = tuple(tuple(tuple(p) for p in layer) for layer in layers)
        return cls(adapter.identity, adapter.max_rank, pieces)


@dataclass(frozen=True, slots=True)
class LoraRun:
    """Rows [row0, row0 + num_rows) of a step's flattened tokens run under adapter ``slot``."""

    row0: int
    num_rows: int
    slot: int


class LoraSlots:
    """``num_slots`` places for adapters, and per layer the kernel's tables of their updates
    (rebuilt when an adapter is installed or removed, between steps)."""

    def __init__(self, config: ModelConfig, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.config = config
        self.adapters: list[PackedLora | None] = [None] * num_slots
        self._tables: list[ctypes.Array[_Table]] = []
        self._keep: list[object] = []  # the arrays the tables point into
        self._rebuild()

    @property
    def num_slots(self) -> int:
        return len(self.adapters)

    def install(self, slot: int, adapter: PackedLora | None) -> None:
        """Put ``adapter`` in ``slot`` (None: empty it)."""
        self.adapters[slot] = adapter
        self._rebuild()

    def step(self, runs: Sequence[LoraRun]) -> LoraStep | None:
        """One step's rows by adapter (None: no row runs under one)."""
        runs = [r for r in runs if r.num_rows > 0]
        if not runs:
            return None
        for run in runs:
            if self.adapters[run.slot] is None:
                raise ValueError(f"LoRA slot {run.slot} holds no adapter")
        return LoraStep(self, runs)

    def table_address(self, layer: int) -> int:
        """The address of layer ``layer``'s 4 tables (``struct lora_table[4]``)."""
        return ctypes.addressof(self._tables[layer])

    def pieces(self, layer: int, projection: int, slot: int) -> tuple[PackedPiece, ...]:
        adapter = self.adapters[slot]
        return () if adapter is None else adapter.pieces[layer][projection]

    def _rebuild(self) -> None:
        tables, keep = [], []
        for layer in range(self.config.num_hidden_layers):
            table = (_Table * len(PROJECTIONS))()
            for p in range(len(PROJECTIONS)):
                structs = [piece.struct() for slot in range(self.num_slots)
                           for piece in self.pieces(layer, p, slot)]  # fmt: skip
                first = [0]
                for slot in range(self.num_slots):
                    first.append(first[-1] + len(self.pieces(layer, p, slot)))
                pieces = (_Piece * max(len(structs), 1))(*structs)
                firsts = (_I * len(first))(*first)
                keep += [pieces, firsts]
                table[p] = _Table(ctypes.addressof(pieces), ctypes.addressof(firsts))
            tables.append(table)
        self._tables, self._keep = tables, keep


class LoraStep:
    """One step's runs of rows by adapter slot, for the compiled layer calls (`runs_address`,
    `LoraSlots.table_address`) and the PyTorch layers (`apply`)."""

    def __init__(self, slots: LoraSlots, runs: Sequence[LoraRun]) -> None:
        self.slots = slots
        self.runs = list(runs)
        count = len(self.runs)
        self._arrays = [(_I * count)(*(getattr(r, f) for r in self.runs))
                        for f in ("row0", "num_rows", "slot")]  # fmt: skip
        self._struct = _Runs(count, *(ctypes.addressof(a) for a in self._arrays))

    @property
    def runs_address(self) -> int:
        return ctypes.addressof(self._struct)

    def table_address(self, layer: int) -> int:
        return self.slots.table_address(layer)

    def apply(
        self, layer: int, projection: int, x: torch.Tensor, out: torch.Tensor, first_row: int = 0
    ) -> None:
        """``out`` [rows, width] += each adapter's update of projection ``projection`` of
        ``layer`` over its rows in [first_row, first_row + rows) of the step (``x``: the
        projection's input [rows, in], the same window)."""
        library = native_layers.library() if native_layers.enabled() else None
        if library is not None and _kernel_takes(x, out):
            table = self.table_address(layer) + projection * ctypes.sizeof(_Table)
            library.pc_lora_apply(
                self.runs_address, table, x.data_ptr(), x.stride(0), x.shape[1], out.data_ptr(),
                out.stride(0), first_row, x.shape[0], int(x.dtype == torch.bfloat16),
                torch.get_num_threads(),
            )  # fmt: skip
            return
        end = first_row + x.shape[0]
        for run in self.runs:
            lo, hi = max(run.row0, first_row), min(run.row0 + run.num_rows, end)
            if hi <= lo:
                continue
            rows = slice(lo - first_row, hi - first_row)
            for piece in self.slots.pieces(layer, projection, run.slot):
                columns = slice(piece.col0, piece.col0 + piece.n)
                out[rows, columns] += piece.delta(x[rows]).to(out.dtype)


def _kernel_takes(x: torch.Tensor, out: torch.Tensor) -> bool:
    """[rows, k] and [rows, width] CPU tensors of one dtype (float32 or bfloat16), rows apart
    by their stride, columns contiguous."""
    return (
        x.dim() == out.dim() == 2
        and x.shape[0] == out.shape[0]
        and x.dtype == out.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == out.device.type == "cpu"
        and x.stride(1) == out.stride(1) == 1
    )
