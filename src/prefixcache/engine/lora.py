"""LoRA adapters in the engine: a request names its adapter as vLLM's `LoRARequest` does, and
`LoraRegistry` loads it, names it by content in the cache, and runs its rows.

- Names: ``add`` registers a name (its files read, checked and named by content: the adapter's
  ``identity``, `prefixcache.model.lora`); ``remove`` unregisters it. A request's adapter
  (`acquire`, `LLM.generate`'s) is registered on first use, and its files are looked at again
  (size and modification time) at each request, so a file changed under the same name is read
  again and is another adapter. A request by name (`acquire_name`, the server's) runs under the
  adapter registered under it when the engine takes it, or is refused (`LoraNotFound`): an
  unload between the server's check and the engine never runs it under the base or loads the
  adapter back. Every change of names runs on the engine's thread, between two steps.
- Memory: at most ``max_cpu_loras`` adapters are held (`LoraSlots`, one slot each; two names of
  the same files share one). One that no request holds is let go, least recently used first,
  to make room; a request arriving for it reads it again. All slots held by live requests: the
  new request is refused (`LoraBusy`).
- Identity: a request's sequence carries the identity as its namespace's adapter, so its blocks
  are the adapter's alone: never the base's or another adapter's, and the same for every name
  of the same files. A removed adapter's blocks can no longer be reached (no request can name
  it); requests already running under it finish with it, and once none does, its cached blocks
  are evicted (``evict``: the engine's), also when its slot was let go before.
- Steps: `step` turns a step's chunks into runs of rows by slot for the model (`LoraStep`); the
  scheduler keeps at most ``max_loras`` adapters in one step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prefixcache.engine.config import LoraConfig
from prefixcache.model.config import ModelConfig
from prefixcache.model.lora import CONFIG_FILE, WEIGHTS_FILE, LoraError, load_adapter
from prefixcache.model.lora_batch import LoraRun, LoraSlots, LoraStep, PackedLora
from prefixcache.sched.request import ScheduledChunk

__all__ = ["LoRARequest", "LoraBusy", "LoraError", "LoraNotFound", "LoraRegistry", "LoadedLora"]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter as vLLM's requests name it: ``lora_name``, a positive ``lora_int_id`` and
    the directory peft saved it in, ``lora_path``."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError("a LoRARequest needs a lora_name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA {self.lora_name!r} needs a lora_path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


class LoraBusy(LoraError):
    """Every adapter slot (``max_cpu_loras``) is held by live requests: retry later."""


class LoraNotFound(LoraError):
    """No adapter is registered under the name a request gave (never, or no longer)."""


@dataclass(slots=True)
class LoadedLora:
    """An adapter in a slot: its layout, the requests that hold it and the names that reach
    it."""

    packed: PackedLora
    slot: int
    users: int = 0
    names: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Name:
    request: LoRARequest
    stamp: tuple[int, ...]  # the files' sizes and modification times when read
    identity: str


class LoraRegistry:
    """The adapters of one engine's model (`LoraConfig`: ``max_loras``, ``max_lora_rank``,
    ``max_cpu_loras``). ``evict(roots)``: evict the cached blocks under these namespace roots
    (the engine's). Names are read from any thread; the rest runs on the engine's thread."""

    def __init__(
        self, model: ModelConfig, config: LoraConfig, evict: Callable[[set[bytes]], object],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype  # the model's: the adapters' weights are kept in it
        self.slots = LoraSlots(model, config.cpu_loras)
        self._evict = evict
        self._names: dict[str, _Name] = {}
        self._loaded: OrderedDict[str, LoadedLora] = OrderedDict()  # by identity, LRU first
        # by identity: the namespace roots its requests' blocks hang from (slot or not)
        self._roots: dict[str, set[bytes]] = {}
        self._lock = threading.Lock()  # names: read by the server's threads

    # ---- names ---------------------------------------------------------------------------

    def read(self, request: LoRARequest) -> tuple[PackedLora, tuple[int, ...]]:
        """Read and check ``request``'s files (any thread): their layout and stamp."""
        path = Path(request.lora_path).expanduser()
        stamp = _stamp(path)
        adapter = load_adapter(path, self.model, self.config.max_lora_rank)
        return PackedLora.of(adapter, self.model, self.dtype), stamp

    def add(self, request: LoRARequest, read: tuple[PackedLora, tuple[int, ...]] | None = None
            ) -> str:  # fmt: skip
        """Register ``request``'s name (replacing an earlier registration of the name) and hold
        its adapter in a slot; ``read``: `read`'s result, else read now. Its identity; raises
        `LoraError` (nothing changed) for a bad adapter or when every slot is held."""
        packed, stamp = read if read is not None else self.read(request)
        with self._lock:
            other = next((n for n in self._names.values()
                          if n.request.lora_int_id == request.lora_int_id
                          and n.request.lora_name != request.lora_name), None)  # fmt: skip
        if other is not None:
            raise LoraError(f"lora_int_id {request.lora_int_id} already names "
                            f"{other.request.lora_name!r}")
        loaded = self._hold(packed)
        self._unname(request.lora_name)
        loaded.names.add(request.lora_name)
        with self._lock:
            self._names[request.lora_name] = _Name(request, stamp, packed.identity)
        self._collect()  # what the name reached before, if its files changed
        return packed.identity

    def remove(self, name: str) -> bool:
        """Unregister ``name`` (False: unknown). Its adapter goes once no other name reaches it
        and no request runs under it, and then its cached blocks with it."""
        if name not in self._names:
            return False
        self._unname(name)
        self._collect()
        return True

    def requests(self) -> list[LoRARequest]:
        """The registered adapters, by name (vLLM's ``list_loras``)."""
        with self._lock:
            return [n.request for _, n in sorted(self._names.items())]

    def identity_of(self, name: str) -> str | None:
        """The identity registered under ``name``, or None (any thread)."""
        with self._lock:
            entry = self._names.get(name)
        return None if entry is None else entry.identity

    def loaded(self) -> dict[str, LoadedLora]:
        """The adapters held now, by identity, least recently used first."""
        return dict(self._loaded)

    # ---- requests ------------------------------------------------------------------------

    def acquire(self, request: LoRARequest) -> str:
        """The identity a request under ``request`` runs with, its adapter held until
        `release`: registered now if its name is new, read again if its files changed."""
        known = self._names.get(request.lora_name)
        if known is None or known.request != request or known.stamp != _stamp(
                Path(request.lora_path).expanduser()) or known.identity not in self._loaded:
            self.add(request)  # fmt: skip
            known = self._names[request.lora_name]
        return self._use(known.identity)

    def acquire_name(self, name: str) -> tuple[str, LoRARequest]:
        """The identity and request of the adapter registered under ``name`` now, held until
        `release` (its slot filled again if it was let go); `LoraNotFound` if none is."""
        known = self._names.get(name)
        if known is None:
            raise LoraNotFound(f"the LoRA adapter {name!r} cannot be found (not loaded, or "
                               "unloaded)")
        if known.identity not in self._loaded:
            self.add(known.request)
            known = self._names[name]
        return self._use(known.identity), known.request

    def _use(self, identity: str) -> str:
        loaded = self._loaded[identity]
        self._loaded.move_to_end(identity)
        loaded.users += 1
        return identity

    def note_roots(self, identity: str, roots: Iterable[bytes]) -> None:
        """A request under ``identity`` hangs its blocks from the namespaces ``roots``."""
        self._roots.setdefault(identity, set()).update(roots)

    def release(self, identity: str) -> None:
        """A request under ``identity`` is done."""
        loaded = self._loaded.get(identity)
        if loaded is not None:
            loaded.users -= 1
            self._collect()

    # ---- steps ---------------------------------------------------------------------------

    def step(self, chunks: Sequence[ScheduledChunk]) -> LoraStep | None:
        """The step's rows by adapter slot (chunks in batch order, rows flattened)."""
        runs: list[LoraRun] = []
        row = 0
        for chunk in chunks:
            identity = chunk.request.seq.adapter
            if identity is not None:
                slot = self._loaded[identity].slot
                last = runs[-1] if runs else None
                if last is not None and last.slot == slot and last.row0 + last.num_rows == row:
                    runs[-1] = LoraRun(last.row0, last.num_rows + chunk.num_new_tokens, slot)
                else:
                    runs.append(LoraRun(row, chunk.num_new_tokens, slot))
            row += chunk.num_new_tokens
        return self.slots.step(runs) if runs else None

    # ---- slots ---------------------------------------------------------------------------

    def _hold(self, packed: PackedLora) -> LoadedLora:
        loaded = self._loaded.get(packed.identity)
        if loaded is None:
            loaded = LoadedLora(packed, self._free_slot())
            self.slots.install(loaded.slot, packed)
            self._loaded[packed.identity] = loaded
        self._loaded.move_to_end(packed.identity)
        return loaded

    def _free_slot(self) -> int:
        used = {entry.slot for entry in self._loaded.values()}
        free = [s for s in range(self.slots.num_slots) if s not in used]
        if free:
            return free[0]
        idle = next((i for i, e in self._loaded.items() if not e.users), None)
        if idle is None:
            raise LoraBusy(f"all {self.slots.num_slots} LoRA slots (max_cpu_loras) hold "
                           "adapters of running requests; retry later")
        entry = self._loaded.pop(idle)  # its blocks stay reachable: its files come back alike
        self.slots.install(entry.slot, None)
        return entry.slot

    def _unname(self, name: str) -> None:
        with self._lock:
            entry = self._names.pop(name, None)
        if entry is not None and entry.identity in self._loaded:
            self._loaded[entry.identity].names.discard(name)

    def _collect(self) -> None:
        """Let go of adapters no name reaches and no request holds, and evict their blocks
        (those of an adapter whose slot was let go before too)."""
        for identity, entry in list(self._loaded.items()):
            if not entry.names and not entry.users:
                del self._loaded[identity]
                self.slots.install(entry.slot, None)
        with self._lock:
            named = {n.identity for n in self._names.values()}
        for identity in [i for i in self._roots if i not in named and i not in self._loaded]:
            self._evict(self._roots.pop(identity))


def _stamp(path: Path) -> tuple[int, ...]:
    """The sizes and modification times of an adapter's two files (0s where missing)."""
    out: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            stat = (path / name).stat()
        except OSError:
            out += [0, 0]
            continue
        out += [stat.st_size, stat.st_mtime_ns]
    return tuple(out)


def lora_requests(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter per prompt from `LLM.generate`'s ``lora_request``: one for all, or a list."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    items = list(lora_request)
    if len(items) != num_prompts:
        raise ValueError(f"{len(items)} LoRA requests for {num_prompts} prompts")
    return items
