"""`load_model`: a built-in name, a checkpoint directory or a .gguf file -> `LoadedModel`.

Ties together config, decoder, weights, tokenizer and identity; the engine's only entry point
into this package. A checkpoint is either a transformers-style directory (config.json,
safetensors, tokenizer.json) or a GGUF file (`prefixcache.model.gguf_checkpoint`); both give the
same `ModelConfig`, `Tokenizer` and parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.attention import KVLayout, PagedKVCache
from prefixcache.attention.kv_format import KVFormat, format_of_dtype
from prefixcache.model import kv_choice, precision, quant_gemm
from prefixcache.model.builtin import (
    BUILTIN_MODELS,
    PACKAGED_MODELS,
    PackagedModelMissing,
    builtin_names,
    cache_dir,
    ensure_builtin,
    ensure_packaged,
    locate_packaged,
)
from prefixcache.model.config import ModelConfig
from prefixcache.model.decoder import WEIGHT_DTYPES, CausalLM
from prefixcache.model.fused_layers import QUANTIZED_KV_WRITTEN
from prefixcache.model.gguf_checkpoint import GGUFCheckpoint, find_gguf
from prefixcache.model.identity import model_identity
from prefixcache.model.precision import Choice, Precision
from prefixcache.model.tokenizer import Tokenizer
from prefixcache.model.weights import load_weights, weight_files
from prefixcache.native import machine

__all__ = [
    "DTYPES",
    "Checkpoint",
    "LoadedModel",
    "ModelLoadError",
    "cpu_has_native_bf16",
    "load_model",
    "open_checkpoint",
    "resolve_dtype",
    "resolve_model_path",
    "resolve_precision",
]

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelLoadError(ValueError):
    """The named model cannot be found or loaded."""


@dataclass(slots=True)
class LoadedModel:
    """A ready model: weights on device, tokenizer, and the identity for the cache namespace."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    path: Path
    identity: str
    dtype: torch.dtype
    device: torch.device
    # how the projections keep their weights (`decoder.WEIGHT_DTYPES`; the dtype's name when
    # they are the parameters themselves) and, with --dtype auto, what chose it
    weight_dtype: str = ""
    choice: Choice | None = None
    # the paged KV cache's layout (None: the activations' dtype) and, where ``auto`` measured
    # it, what chose it
    kv_format: KVFormat | None = None
    kv_measured: kv_choice.KVChoice | None = None

    @property
    def precision(self) -> str:
        """``float32``, ``bfloat16``, or ``float32+<weights>`` (weights kept otherwise)."""
        dtype = str(self.dtype).removeprefix("torch.")
        weights = self.weight_dtype or dtype
        return dtype if weights == dtype else f"{dtype}+{weights}"

    @property
    def kv_layout(self) -> KVLayout:
        """The shape of this model's KV, in its KV layout: every KV size is computed from it."""
        return KVLayout.of(self.config, self.dtype, self.kv_format)

    def kv_layout_for(self, kv_cache_dtype: str) -> KVLayout:
        """`kv_layout` with the cache kept as ``kv_cache_dtype`` (``auto``: as loaded), or a
        clear `ValueError` where this model cannot keep it so."""
        if kv_cache_dtype == "auto":
            return self.kv_layout
        return KVLayout.of(self.config, self.dtype, kv_choice.resolve(kv_cache_dtype, self.dtype))

    def kernels(self, layout: KVLayout | None = None) -> dict[str, Any]:
        """Which kernels run the model (`CausalLM.kernels`) over a KV cache of ``layout``
        (None: `kv_layout`)."""
        found = (layout or self.kv_layout).format
        written = found.storage == self.dtype or found.name in QUANTIZED_KV_WRITTEN
        return self.model.kernels(None if written else found.name)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """Paged K/V storage shaped for this model, in its dtype and on its device."""
        return self.kv_layout.allocate(num_blocks, block_size, self.device)


def resolve_model_path(name_or_path: str) -> Path:
    """A built-in name (generated on first use, or a packaged model's file), an existing
    checkpoint directory, or a .gguf file."""
    if name_or_path in BUILTIN_MODELS:
        return ensure_builtin(name_or_path)
    if name_or_path in PACKAGED_MODELS:
        try:
            return ensure_packaged(name_or_path)
        except PackagedModelMissing as exc:
            raise ModelLoadError(str(exc)) from None
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    names = ", ".join(builtin_names())
    raise ModelLoadError(
        f"model {name_or_path!r} is neither a built-in model ({names}), "
        "a checkpoint directory nor a .gguf file"
    )


@dataclass(slots=True)
class Checkpoint:
    """What a checkpoint gives before its weights are read: config, tokenizer, identity."""

    path: Path  # a checkpoint directory, or a .gguf file
    config: ModelConfig
    gguf: GGUFCheckpoint | None = None
    blocks_file: GGUFCheckpoint | None = None  # the GGUF whose blocks back it (packaged models)

    @property
    def quantized(self) -> GGUFCheckpoint | None:
        """The GGUF file whose quantized blocks ``--weight-dtype gguf`` runs, if any."""
        return self.gguf or self.blocks_file

    def tokenizer(self) -> Tokenizer:
        return self.gguf.tokenizer() if self.gguf else Tokenizer.from_dir(self.path)

    def load_weights(self, model: CausalLM) -> None:
        if self.gguf:
            self.gguf.load_weights(model, self.config)
        else:
            load_weights(model, self.path)

    def identity(self, dtype: str) -> str:
        """The fingerprint that roots the cache namespace (covers every byte of the weights)."""
        files = [self.gguf.path] if self.gguf else weight_files(self.path)
        return model_identity(self.path, self.config, dtype, files, cache_dir() / "digests")


def open_checkpoint(name_or_path: str) -> Checkpoint:
    """Resolve ``name_or_path`` and read its configuration (no weights yet)."""
    path = resolve_model_path(name_or_path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        gguf = GGUFCheckpoint(gguf_file)
        return Checkpoint(gguf_file, gguf.config(), gguf)
    source = None
    if name_or_path in PACKAGED_MODELS:  # converted from a GGUF file that keeps its blocks
        source = GGUFCheckpoint(locate_packaged(name_or_path))
    return Checkpoint(path, ModelConfig.from_dir(path), blocks_file=source)


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    device: str = "cpu",
    pack_weights: bool = True,
    weight_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load config, weights (cast to ``dtype``) and tokenizer; no network access.

    ``pack_weights``: on CPU in float32, also keep each projection weight in MKL's packed GEMM
    layout (`prefixcache.model.packed_gemm`): faster steps for about the projections' size
    again in memory.
    ``dtype="auto"``: the precision measured fastest here (`prefixcache.model.precision`) on
    the CPU, the checkpoint's own elsewhere. ``weight_dtype``: how a float32 model keeps its
    projection weights (`WEIGHT_DTYPES`: bfloat16, q8_0, or the GGUF file's blocks); ``auto``
    keeps them as ``dtype`` unless ``dtype="auto"`` chose otherwise. ``kv_cache_dtype``: the
    paged KV cache's layout (`kv_choice`: ``auto`` keeps the activations' dtype, or with
    ``dtype="auto"`` the smallest layout that passes the same fidelity gate).
    """
    if dtype not in DTYPES and dtype != "auto":
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: auto, {', '.join(DTYPES)})")
    if weight_dtype not in (*WEIGHT_DTYPES, "auto"):
        raise ModelLoadError(f"unsupported weight dtype {weight_dtype!r} "
                             f"(supported: auto, {', '.join(WEIGHT_DTYPES)})")  # fmt: skip
    checkpoint = open_checkpoint(name_or_path)
    measured = dtype == "auto"
    dtype, weights, choice = resolve_precision(checkpoint, dtype, weight_dtype, device)
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    try:
        layout, measured_kv = resolve_kv_format(checkpoint, kv_cache_dtype, dtype, weights,
                                                measured and choice is not None)  # fmt: skip
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    model = _build(checkpoint, torch_dtype, torch_device, pack_weights, weights)
    precision = dtype if weights == dtype else f"{dtype}+{weights}"
    return LoadedModel(
        checkpoint.config,
        model,
        checkpoint.tokenizer(),
        checkpoint.path,
        checkpoint.identity(precision),
        torch_dtype,
        torch_device,
        weights,
        choice,
        layout,
        measured_kv,
    )


def resolve_kv_format(
    checkpoint: Checkpoint, kv_cache_dtype: str, dtype: str, weights: str, measure: bool
) -> tuple[KVFormat | None, kv_choice.KVChoice | None]:
    """The KV layout for ``--kv-cache-dtype`` under the resolved precision (None: the
    activations' dtype) and, where ``auto`` measured it (``measure``: the precision was
    measured too), what chose it. A layout the model cannot keep is a `ValueError`."""
    torch_dtype = DTYPES[dtype]
    if kv_cache_dtype != "auto":
        found = kv_choice.resolve(kv_cache_dtype, torch_dtype)
        found.check_head_dim(checkpoint.config.head_dim)
        if found == format_of_dtype(torch_dtype):
            return None, None
        asked = kv_choice.measured(found.name, _kv_fidelity(checkpoint, dtype, weights))
        return found, asked
    if not measure:
        return None, None
    measured = kv_choice.choose(torch_dtype, checkpoint.config.head_dim,
                                _kv_fidelity(checkpoint, dtype, weights))  # fmt: skip
    log.info("KV cache: %s", measured.reason)
    found = kv_choice.resolve(measured.layout, torch_dtype)
    return (None if found == format_of_dtype(torch_dtype) else found), measured


def resolve_precision(
    checkpoint: Checkpoint, dtype: str, weight_dtype: str = "auto", device: str = "cpu"
) -> tuple[str, str, Choice | None]:
    """(dtype, weights, the measurement if one chose them) for ``--dtype``/``--weight-dtype``:
    ``auto`` measured on the CPU (`precision.choose`), the checkpoint's dtype elsewhere;
    weights other than the dtype need float32 activations and a CPU, and ``gguf`` a GGUF file
    with blocks."""
    choice = None
    if dtype == "auto" and weight_dtype == "auto" and device == "cpu":
        gguf = checkpoint.quantized
        kinds = set(gguf.tensor_types().values()) if gguf else set()
        options = precision.candidates(bool(kinds & set(quant_gemm.GGUF_NATIVE_TYPES)))
        form = (quant_gemm.NIBBLES if kinds & {"Q4_0", "Q4_1", "Q4_K"} else quant_gemm.BYTES_MIN
                if "Q5_1" in kinds else quant_gemm.BYTES)  # fmt: skip
        choice = precision.choose(checkpoint.config, options, form, _fidelity(checkpoint))
        log.info("%s", choice.describe())
        return choice.precision.dtype, choice.precision.weights, choice
    if dtype == "auto":
        dtype = "float32" if weight_dtype not in ("auto", "float32") else resolve_dtype(
            checkpoint.config.torch_dtype)  # fmt: skip
    weights = dtype if weight_dtype == "auto" else weight_dtype
    if weights != dtype and (dtype != "float32" or device != "cpu"):
        raise ModelLoadError(f"--weight-dtype {weights} runs float32 activations on the CPU "
                             f"(got --dtype {dtype} on {device})")  # fmt: skip
    if weights == "gguf" and checkpoint.quantized is None:
        raise ModelLoadError("--weight-dtype gguf needs a GGUF model (a .gguf file or a "
                             "packaged GGUF model such as smollm2)")  # fmt: skip
    return dtype, weights, choice


def _fidelity(checkpoint: Checkpoint) -> Callable[[Precision], dict[str, Any]]:
    """`precision.fidelity_of` float32 for a precision, over `precision.FIDELITY_TEXT` with the
    checkpoint's own weights: measured once per model, precision, CPU and kernel sources (the
    bits a precision gives depend on the kernels) and kept beside the timings; float32's
    logits computed at most once per call of `resolve_precision`."""
    from prefixcache.native import compile_flags, cpu_signature, sources_digest

    config, cpu = checkpoint.config, torch.device("cpu")
    reference: list[torch.Tensor] = []

    def logits(dtype: torch.dtype, weights: str) -> torch.Tensor:
        ids = checkpoint.tokenizer().encode(precision.FIDELITY_TEXT)
        model = _build(checkpoint, dtype, cpu, True, weights)
        return precision.all_logits(model, config, ids, dtype)

    def of(option: Precision) -> dict[str, Any]:
        key = hashlib.sha256(json.dumps([
            precision.CALIBRATION_VERSION, checkpoint.identity("float32"), option.label,
            cpu_signature(), sources_digest(), compile_flags(), torch.__version__,
            precision.FIDELITY_TEXT,
        ]).encode()).hexdigest()[:20]  # fmt: skip

        def measure() -> dict[str, Any]:
            if not reference:
                reference.append(logits(torch.float32, "float32"))
            return precision.fidelity_of(reference[0], logits(DTYPES[option.dtype],
                                                              option.weights))

        path = cache_dir() / "calibration" / f"fidelity-{key}.json"
        return machine.measured_once(path, measure)[0]

    return of


def _kv_fidelity(
    checkpoint: Checkpoint, dtype: str, weights: str
) -> Callable[[KVFormat], dict[str, Any]]:
    """`precision.fidelity_of` float32 (float32 KV) for the model in ``dtype`` with ``weights``
    over a KV layout, over `precision.FIDELITY_TEXT`: measured once per model, precision,
    layout, CPU and kernel sources, kept beside `_fidelity`'s."""
    from prefixcache.native import compile_flags, cpu_signature, sources_digest

    config, cpu = checkpoint.config, torch.device("cpu")
    ids = checkpoint.tokenizer().encode(precision.FIDELITY_TEXT)
    built: dict[str, Any] = {}

    def logits(torch_dtype: torch.dtype, form: str, layout: KVFormat | None) -> torch.Tensor:
        key = f"{torch_dtype}+{form}"
        if key not in built:
            built[key] = _build(checkpoint, torch_dtype, cpu, True, form)
        return precision.all_logits(built[key], config, ids, torch_dtype, layout)

    def of(layout: KVFormat) -> dict[str, Any]:
        key = hashlib.sha256(json.dumps([
            precision.CALIBRATION_VERSION, checkpoint.identity("float32"), dtype, weights,
            layout.layout, cpu_signature(), sources_digest(), compile_flags(),
            torch.__version__, precision.FIDELITY_TEXT,
        ]).encode()).hexdigest()[:20]  # fmt: skip

        def measure() -> dict[str, Any]:
            reference = logits(torch.float32, "float32", None)
            return precision.fidelity_of(reference, logits(DTYPES[dtype], weights, layout))

        path = cache_dir() / "calibration" / f"fidelity-kv-{key}.json"
        return machine.measured_once(path, measure)[0]

    return of


def resolve_dtype(checkpoint_dtype: str | None) -> str:
    """``--dtype auto``: a bfloat16 (or float16) checkpoint runs in bfloat16 where this CPU has
    native bf16 dot products (AVX512_BF16 or AMX), as vLLM's CPU backend does (a quantized GGUF
    counts as bfloat16: `GGUFCheckpoint.weights_dtype`); everything else, and any CPU without
    them, in float32."""
    name = (checkpoint_dtype or "").replace("torch.", "")
    if name in ("bfloat16", "float16") and cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def cpu_has_native_bf16() -> bool:
    """The CPU advertises AVX512_BF16 or AMX-BF16 (Linux's /proc/cpuinfo; False elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialised storage on ``device`` for every parameter and buffer built on the meta
    device, floating point ones in ``dtype`` (the checkpoint fills them): what
    ``to_empty(device=device).to(dtype)`` does, without a float32 copy first and without the
    meta device's reference implementations, which import sympy (resident memory and start-up
    time for nothing; figures in docs/performance.md)."""
    def empty_like(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    for module in model.modules():
        parameters, buffers = module._parameters, module._buffers
        for name, p in parameters.items():
            if p is not None and p.is_meta:
                parameters[name] = torch.nn.Parameter(empty_like(p), False)
        for name, b in buffers.items():
            if b is not None and b.is_meta:
                buffers[name] = empty_like(b)


def _build(
    checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, pack: bool, weights: str
) -> CausalLM:
    config = checkpoint.config
    with torch.device("meta"):
        model = CausalLM(config)
    _materialize(model, device, dtype)
    if config.tie_word_embeddings:  # each parameter was re-created: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    checkpoint.load_weights(model)
    if DTYPES.get(weights) == dtype:  # the parameters themselves
        model.prepare_cpu_projections(pack)
    else:
        gguf = checkpoint.quantized
        blocks = gguf.projection_blocks(config) if gguf is not None else None
        counts = model.store_weights(weights, blocks)
        log.info("projection weights kept as %s", ", ".join(f"{k} x{n}" for k, n in counts.items()))
    model.init_rotary()
    return model.eval()
