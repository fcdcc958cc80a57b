"""``--dtype auto``: the precision this model runs fastest in on the CPU in front of it, chosen by
measuring, not by reading the CPU's flags.

Whether bfloat16 pays depends on the machine: on an AMD Zen 4 or 5 its products run at about
twice the float32 rate, on an Intel Xeon without AMX at half of it, and a decode step, which
streams every weight once, gains from any storage narrower than float32 whatever the products
cost. So the candidates are measured on this model's own projection shapes:

- ``float32``: float32 everywhere;
- ``bfloat16``: bfloat16 weights, activations and KV cache (bfloat16 products, float32 sums);
- ``float32+bfloat16``: bfloat16 weights widened in the float32 GEMM (half the bytes a step
  streams, float32 products: results closer to float32 than bfloat16's);
- ``float32+gguf``: a GGUF file's own quantized blocks (`quant_gemm`), where the file has them.

Each candidate packs random weights of the model's projection shapes (as many layers as fit in
`SAMPLE_BYTES`, so that a step streams them from memory as the model's would) the way the model
would pack them, and times a prefill of `PREFILL_ROWS` tokens and a decode step of `DECODE_ROWS`
sequences through them (medians of `REPEATS` after a warm-up round, candidates alternating).
To each, the attention of its compute dtype is added (`_Attention`: float32 or bfloat16 queries
and KV cache, through the compiled kernels as the model's steps run them, over a prefill of the
same tokens and a decode step of the same sequences, `ATTENTION_CONTEXT` keys each): quantized
or bfloat16 weights under float32 compute keep float32's attention, which at long contexts is
what a decode step spends most on. The score is one typical request's share: its prefill plus 8
decode steps (a 128-token answer among 16 running). A candidate whose weights would not fit in
the memory the machine has free is left out. The result
is kept under the cache directory per CPU model and flags, thread count, model shape and kernel
sources, so only the first start on a machine pays the few seconds it takes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prefixcache.model import native_layers, panel_gemm, quant_gemm
from prefixcache.model.config import ModelConfig
from prefixcache.native import machine
from prefixcache.paths import cache_dir

if TYPE_CHECKING:
    from prefixcache.attention.kv_format import KVFormat
    from prefixcache.model.decoder import CausalLM
    from prefixcache.model.layers import Projection
    from prefixcache.model.quant_gemm import QuantBlocks

__all__ = ["Choice", "Precision", "all_logits", "candidates", "choose", "fidelity_of"]

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 3
# float32 weights measured per candidate, at most (at least one layer): several times a CPU's
# last-level cache per core complex, so that a step streams them as the model's would, and small
# enough that a first start measures in seconds (what it takes: docs/model.md)
SAMPLE_BYTES = 128 << 20
PREFILL_ROWS = 512
DECODE_ROWS = 16
DECODE_STEPS_PER_REQUEST = 8  # a 128-token answer with 16 sequences running: 128 / 16 steps
REPEATS = 3
# The attention each compute dtype runs (float32 or bfloat16 queries and KV cache): a prefill of
# PREFILL_ROWS new tokens, and a decode step of DECODE_ROWS sequences over ATTENTION_CONTEXT keys
# each, the first half shared; over up to ATTENTION_LAYERS layers' caches in turn (K and V from
# memory, as in a step), scaled to the model's layers
ATTENTION_CONTEXT = 1024
ATTENTION_LAYERS = 4
# Fidelity: a candidate other than float32 is chosen only if, over `FIDELITY_TEXT` with the
# model's own weights, its next-token distributions stay this close to float32's (the
# Kullback-Leibler divergence from float32's, mean over the text's tokens, in nats) and its most
# likely token is float32's at this share of them: llama.cpp's perplexity --kl-divergence
# figures. The bounds are those of llama.cpp's 5-bit K-quants on 7B models (mean KL about 0.01,
# the same top token about 96% of the time), with room for a small model's many near-ties in
# the top-1 share: they admit its Q8_0 (about 0.001) and reject a form whose answers drift.
MAX_MEAN_KL = 0.01
MIN_TOP1_AGREEMENT = 0.90
FIDELITY_TEXT = (
    "The printing press changed how ideas travelled. Before it, a book was copied by hand, one "
    "page at a time, and a library of a few hundred volumes was a treasure. Around 1450 "
    "Johannes Gutenberg combined movable metal type, an oil-based ink and a screw press, and "
    "within fifty years presses were working in more than 250 European towns.\n\n"
    "Three effects stand out:\n1. Prices fell: a printed Bible cost a fraction of a copied one."
    "\n2. Texts became identical, so scholars could cite page 42 and mean the same words.\n"
    "3. Ordinary people began to read pamphlets, news sheets and almanacs.\n\n"
    "Q: What is 17 multiplied by 3?\nA: 17 x 3 = 51.\n\n"
    "def word_count(text):\n    return len(text.split())\n\n"
    "Today the same story repeats with software: copying is nearly free, and the question is "
    "no longer how to make a copy but which copy to trust."
)


@dataclass(frozen=True, slots=True)
class Precision:
    """What a model runs in: ``dtype`` for activations and the KV cache, ``weights`` for how the
    projections keep their weights (`prefixcache.model.decoder.WEIGHT_DTYPES`, or ``dtype``)."""

    dtype: str
    weights: str

    @property
    def label(self) -> str:
        return self.dtype if self.weights == self.dtype else f"{self.dtype}+{self.weights}"

    @classmethod
    def parse(cls, label: str) -> Precision:
        dtype, _, weights = label.partition("+")
        return cls(dtype, weights or dtype)


@dataclass(slots=True)
class Choice:
    """The chosen precision and what was measured: per candidate label, prefill tokens/s,
    decode step ms, the attention's share of both and the score (seconds of one typical
    request's projections and attention)."""

    precision: Precision
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu: str = ""
    reason: str = ""

    def describe(self) -> str:
        parts = [f"{label}: prefill {f['prefill_tokens_per_s']:.0f} tok/s, decode step "
                 f"{f['decode_step_ms']:.2f} ms{_fidelity_text(f.get('fidelity'))}"
                 for label, f in self.figures.items()]  # fmt: skip
        head = f"--dtype auto chose {self.precision.label} ({self.reason}) on {self.cpu}"
        return head + ("; " + "; ".join(parts) if parts else "")

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.precision.label, "reason": self.reason, "cpu": self.cpu,
                "candidates": self.figures}  # fmt: skip


def candidates(has_gguf_blocks: bool) -> list[Precision]:
    """What ``--dtype auto`` measures here: float32 always; bfloat16 and bfloat16 weights where
    their kernels are vector code on this CPU; the GGUF file's blocks where the file has them
    and the quantized kernel is vector code."""
    out = [Precision("float32", "float32")]
    if native_layers.available() and panel_gemm.vectorised(torch.bfloat16):
        out.append(Precision("bfloat16", "bfloat16"))
    if native_layers.available() and panel_gemm.vectorised(torch.float32):
        out.append(Precision("float32", "bfloat16"))
    if has_gguf_blocks and quant_gemm.vectorised() and quant_gemm.available():
        out.append(Precision("float32", "gguf"))
    return out


def choose(
    config: ModelConfig,
    options: list[Precision],
    blocks_form: int = quant_gemm.NIBBLES,
    fidelity: Callable[[Precision], dict[str, Any]] | None = None,
) -> Choice:
    """The fastest of ``options`` for ``config``'s shape here that keeps the model's answers:
    the timings from the cache, else measured (and cached). ``blocks_form``: how the GGUF
    file's blocks are kept (`quant_gemm.NIBBLES` for its 4-bit types, `quant_gemm.BYTES` /
    ``BYTES_MIN`` for the others). ``fidelity``: a candidate's `fidelity_of` float32 on the
    model's own weights (cached by the caller), asked for in order of speed until one is within
    the bounds (float32 needs none): a faster one outside them is passed over."""
    from prefixcache.native import compile_flags, cpu_signature, sources_digest

    cpu = _cpu_name()
    fitting = [p for p in options if _weight_bytes(config, p) <= _free_memory()]
    if not fitting:
        fitting = [min(options, key=lambda p: _weight_bytes(config, p))]
    if len(options) == 1:
        return Choice(options[0], {}, cpu, "the only candidate: no bfloat16 or quantized kernel "
                      "is vector code on this CPU")  # fmt: skip
    if len(fitting) == 1:
        return Choice(fitting[0], {}, cpu, "the only one that fits in memory")
    key = hashlib.sha256(json.dumps([
        CALIBRATION_VERSION, cpu_signature(), torch.get_num_threads(), _shape(config),
        [p.label for p in fitting], blocks_form, sources_digest(), compile_flags(),
        torch.__version__,
    ]).encode()).hexdigest()[:20]  # fmt: skip
    path = cache_dir() / "calibration" / f"{key}.json"

    def measure() -> dict[str, Any]:
        figures = _measure(config, fitting, blocks_form)
        best = min(fitting, key=lambda p: figures[p.label]["score_s"])
        return Choice(best, figures, cpu, "measured").as_dict()

    # one measurement per machine at a time: replicas starting together would otherwise time
    # each other's load and could choose differently (and so not share a cache namespace)
    data, fresh = machine.measured_once(path, measure)
    choice = _from_dict(data, "measured" if fresh else "measured at an earlier start")
    if choice is None:  # a damaged file: measured again, not trusted
        path.unlink(missing_ok=True)
        data, _ = machine.measured_once(path, measure)
        choice = _from_dict(data, "measured")
    assert choice is not None
    if fidelity is not None and choice.figures and Precision("float32", "float32") in fitting:
        _keep_answers(choice, fitting, fidelity)  # (float32's logits are the reference)
    return choice


def _keep_answers(
    choice: Choice, fitting: list[Precision], fidelity: Callable[[Precision], dict[str, Any]]
) -> None:
    """The fastest of ``fitting`` within the fidelity bounds becomes the choice; the figures of
    those checked join the candidates'."""
    passed_over = []
    for option in sorted(fitting, key=lambda p: choice.figures[p.label]["score_s"]):
        if option.label != "float32":
            figures = fidelity(option)
            choice.figures[option.label]["fidelity"] = figures | {
                "eligible": within_bounds(figures)}  # fmt: skip
            if not within_bounds(figures):
                passed_over.append(option.label)
                continue
        if passed_over:
            choice.reason += (f"; {', '.join(passed_over)} faster but outside the fidelity "
                              f"bounds (mean KL <= {MAX_MEAN_KL}, top-1 >= "
                              f"{MIN_TOP1_AGREEMENT:.0%})")  # fmt: skip
        choice.precision = option
        return


def fidelity_of(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, Any]:
    """How close ``logits`` [tokens, vocab] are to float32's ``reference`` over the same tokens,
    as llama.cpp states a quantization's: the KL divergence of the next-token distribution from
    float32's (mean, 99th percentile and maximum over the tokens, in nats) and the share of
    tokens whose most likely next token is float32's."""
    ref = torch.log_softmax(reference.double(), dim=-1)
    own = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref.exp() * (ref - own)).sum(-1).clamp(min=0)
    top1 = float((ref.argmax(-1) == own.argmax(-1)).double().mean())
    mean_kl = float(kl.mean())
    return {"tokens": int(kl.numel()), "mean_kl": mean_kl,
            "p99_kl": float(torch.quantile(kl, 0.99)), "max_kl": float(kl.max()),
            "top1_agreement": top1}  # fmt: skip


def within_bounds(figures: dict[str, Any]) -> bool:
    """Whether `fidelity_of`'s ``figures`` are within `MAX_MEAN_KL` and `MIN_TOP1_AGREEMENT`."""
    mean_kl, top1 = float(figures["mean_kl"]), float(figures["top1_agreement"])
    return mean_kl <= MAX_MEAN_KL and top1 >= MIN_TOP1_AGREEMENT


def all_logits(
    model: CausalLM,
    config: ModelConfig,
    ids: list[int],
    dtype: torch.dtype,
    kv_format: KVFormat | None = None,
) -> torch.Tensor:
    """The logits [len(ids), vocab] (float32) at every position of one prefill of ``ids``
    through ``model`` over a paged cache of its own dtype, or of ``kv_format`` (every position
    attends the keys and values as that layout stores them)."""
    from prefixcache.attention import AttentionMetadata, PagedKVCache

    block = 16
    num_blocks = -(-len(ids) // block)
    cache = PagedKVCache(config.num_hidden_layers, num_blocks, block, config.num_key_value_heads,
                         config.head_dim, dtype=dtype, kv_format=kv_format)  # fmt: skip
    meta = AttentionMetadata.build([list(range(num_blocks))], [0], [len(ids)], block)
    meta.logits_indices = torch.arange(len(ids))
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor(ids), meta.positions, cache, meta)
    return logits.float()


def _fidelity_text(figures: dict[str, Any] | None) -> str:
    if not figures:
        return ""
    verdict = "" if figures["eligible"] else ", outside the bounds"
    return (f", KL {figures['mean_kl']:.4f}, top-1 {100 * figures['top1_agreement']:.1f}%"
            f"{verdict}")


def _shape(config: ModelConfig) -> list[int]:
    c = config
    return [c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.num_hidden_layers, int(c.attention_bias)]  # fmt: skip


def _layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of a layer's four projections."""
    c = config
    width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    q_size = c.num_attention_heads * c.head_dim
    return [(c.hidden_size, width), (q_size, c.hidden_size),
            (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]


def _weight_bytes(config: ModelConfig, precision: Precision) -> int:
    """The projections' and LM head's weights as the model keeps them (parameter and packed
    copy)."""
    per_layer = sum(i * o for i, o in _layer_shapes(config))
    count = per_layer * config.num_hidden_layers + config.hidden_size * config.vocab_size
    per_value = {"float32": 8.0, "bfloat16": 4.0, "gguf": 3.2, "q8_0": 3.2}[precision.weights]
    return int(count * per_value)


def _free_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _measure(
    config: ModelConfig, options: list[Precision], blocks_form: int
) -> dict[str, dict[str, Any]]:
    """Each candidate's figures over sample weights of the model's shapes (the module
    docstring's method)."""
    gen = torch.Generator().manual_seed(0)
    sample = _SampleWeights.draw(config, gen)
    runs = {
        p.label: (sample.projections(p, blocks_form), getattr(torch, p.dtype)) for p in options
    }
    attention = {dtype: _Attention(config, dtype, gen) for dtype in {d for _, d in runs.values()}}
    times: dict[str, dict[int, list[float]]] = {
        label: {PREFILL_ROWS: [], DECODE_ROWS: []} for label in runs
    }
    with torch.inference_mode():
        for repeat in range(REPEATS + 1):
            for label, (projections, dtype) in runs.items():
                for rows in (PREFILL_ROWS, DECODE_ROWS):
                    seconds = sample.time_step(projections, dtype, rows, gen)
                    if repeat:  # the first round warms up
                        times[label][rows].append(seconds)
            for each in attention.values():
                each.run(keep=repeat > 0)
    scale = config.num_hidden_layers / sample.num_layers
    return {
        label: _figures(by_rows, scale, attention[runs[label][1]])
        for label, by_rows in times.items()
    }


def _figures(
    by_rows: dict[int, list[float]], scale: float, attention: _Attention
) -> dict[str, Any]:
    """One candidate's figures: its projections' median step times over the sample's layers,
    scaled to the model's, plus its attention's."""
    attend_prefill, attend_decode = attention.per_model()
    prefill = statistics.median(by_rows[PREFILL_ROWS]) * scale + attend_prefill
    decode = statistics.median(by_rows[DECODE_ROWS]) * scale + attend_decode
    return {
        "prefill_tokens_per_s": PREFILL_ROWS / prefill,
        "decode_step_ms": decode * 1e3,
        "attention_ms": {"prefill": attend_prefill * 1e3, "decode_step": attend_decode * 1e3},
        "score_s": prefill + DECODE_STEPS_PER_REQUEST * decode,
    }


@dataclass(slots=True)
class _SampleWeights:
    """Random weights of the model's projection shapes, as many layers as fit in
    `SAMPLE_BYTES`, and an LM head: what each candidate packs its own way."""

    config: ModelConfig
    shapes: list[tuple[int, int]]  # (in, out) of a layer's projections
    num_layers: int
    weights: list[torch.Tensor]  # [out, in] each, layer after layer
    head: torch.Tensor  # [vocab, hidden]

    @classmethod
    def draw(cls, config: ModelConfig, gen: torch.Generator) -> _SampleWeights:
        shapes = _layer_shapes(config)
        layer_bytes = 4 * sum(i * o for i, o in shapes)
        num_layers = max(1, min(config.num_hidden_layers, SAMPLE_BYTES // max(layer_bytes, 1)))
        weights = [torch.randn(o, i, generator=gen) * i**-0.5
                   for _ in range(num_layers) for i, o in shapes]  # fmt: skip
        head = torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.05
        return cls(config, shapes, num_layers, weights, head)

    def projections(self, precision: Precision, blocks_form: int) -> list[Projection]:
        """The sample's projections kept as ``precision`` keeps them, the LM head last."""
        from prefixcache.model.decoder import _stored_copy  # the model's own choice of copy
        from prefixcache.model.layers import Projection

        dtype = getattr(torch, precision.dtype)
        projections = []
        for w in [*self.weights, self.head]:
            linear = Projection(w.shape[1], w.shape[0], bias=False)
            linear.weight.data = w.to(dtype)
            if precision.weights == precision.dtype:
                _pack_like_model(linear, dtype)
            else:
                gguf = precision.weights == "gguf"
                source = (lambda _name, w=w: _stand_in_blocks(w, blocks_form)) if gguf else None
                linear.keep(_stored_copy("", w, precision.weights, source))
            projections.append(linear)
        return projections

    def time_step(
        self, projections: list[Projection], dtype: torch.dtype, rows: int, gen: torch.Generator
    ) -> float:
        """Seconds of the layers' projections over ``rows`` tokens and the LM head over the rows
        that get logits (a prefill's last token, every decoded sequence)."""
        xs = {i: torch.randn(rows, i, generator=gen).to(dtype) for i, _ in self.shapes}
        last = torch.randn(1 if rows == PREFILL_ROWS else rows, self.config.hidden_size,
                           generator=gen).to(dtype)  # fmt: skip
        start = time.perf_counter()
        for linear in projections[:-1]:
            linear(xs[linear.in_features])
        projections[-1](last)
        return time.perf_counter() - start


def _stand_in_blocks(weight: torch.Tensor, blocks_form: int) -> QuantBlocks:
    """Stand-in blocks of the file's form: 4-bit values, or 8-bit without / with minimums."""
    q, d, _ = quant_gemm.quantize_q8_0(weight.numpy())
    m = (d.astype("float32") * -8).astype("float16")
    if blocks_form == quant_gemm.NIBBLES:
        q = (q.astype("int16") // 16 + 8).clip(0, 15).astype("int8")
    return q, d, None if blocks_form == quant_gemm.BYTES else m, "sample"


class _Attention:
    """The attention of one compute dtype at the calibration's sizes (`ATTENTION_CONTEXT`):
    through the compiled kernels where they take it, as the model's steps would, else torch's
    SDPA over the same keys already gathered."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, gen: torch.Generator) -> None:
        from prefixcache.attention import native_attention

        heads, kv_heads, dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )  # fmt: skip
        shared = own = ATTENTION_CONTEXT // 2
        slots = shared + DECODE_ROWS * own + PREFILL_ROWS
        layer_bytes = 2 * slots * kv_heads * dim * torch.finfo(dtype).bits // 8
        self.layers = max(1, min(ATTENTION_LAYERS, config.num_hidden_layers,
                                 SAMPLE_BYTES // max(layer_bytes, 1)))  # fmt: skip
        self.scale_to_model = config.num_hidden_layers / self.layers
        self.caches = [
            (torch.randn(slots, kv_heads, dim, generator=gen).to(dtype),
             torch.randn(slots, kv_heads, dim, generator=gen).to(dtype))
            for _ in range(self.layers)
        ]  # fmt: skip
        q_decode = torch.randn(DECODE_ROWS, heads, dim, generator=gen).to(dtype)
        q_prefill = torch.randn(PREFILL_ROWS, heads, dim, generator=gen).to(dtype)
        shared_slots = torch.arange(shared)
        tail_slots = (shared + torch.arange(DECODE_ROWS * own)).view(DECODE_ROWS, own)
        prefill_slots = torch.arange(slots - PREFILL_ROWS, slots)
        score_scale = dim**-0.5
        self.times: tuple[list[float], list[float]] = ([], [])
        # one prefill's or decode step's attention over one layer's cache (k, v)
        self._prefill: Callable[[torch.Tensor, torch.Tensor], object]
        self._decode: Callable[[torch.Tensor, torch.Tensor], object]
        k0, v0 = self.caches[0]
        if native_attention.applies_to(dtype, k0.device, k0, v0):
            out_decode, out_prefill = torch.empty_like(q_decode), torch.empty_like(q_prefill)
            decode = native_attention.PreparedDecode(
                q_decode, k0, v0, shared_slots, tail_slots,
                torch.full((DECODE_ROWS,), own, dtype=torch.int32), out_decode,
            )  # fmt: skip
            prefill = native_attention.PreparedAttend(
                q_prefill, k0, v0, prefill_slots, out_prefill
            )
            self._prefill = lambda k, v: prefill(q_prefill, k, v, score_scale, out_prefill)
            self._decode = lambda k, v: decode(q_decode, k, v, score_scale, out_decode)
            return
        import torch.nn.functional as F

        def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool) -> None:
            F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                is_causal=causal, scale=score_scale, enable_gqa=True,
            )  # fmt: skip

        every = torch.cat([shared_slots.expand(DECODE_ROWS, -1), tail_slots], 1)

        def decode_each(k: torch.Tensor, v: torch.Tensor) -> None:
            for b in range(DECODE_ROWS):
                sdpa(q_decode[b : b + 1], k[every[b]], v[every[b]], False)

        self._prefill = lambda k, v: sdpa(q_prefill, k[prefill_slots], v[prefill_slots], True)
        self._decode = decode_each

    def run(self, keep: bool) -> None:
        """One prefill and one decode step over every layer's cache; kept unless warming up."""
        for index, function in enumerate((self._prefill, self._decode)):
            start = time.perf_counter()
            for k, v in self.caches:
                function(k, v)
            if keep:
                self.times[index].append((time.perf_counter() - start) * self.scale_to_model)

    def per_model(self) -> tuple[float, float]:
        """Seconds of a prefill's and of a decode step's attention over the model's layers."""
        return statistics.median(self.times[0]), statistics.median(self.times[1])


def _pack_like_model(linear: Projection, dtype: torch.dtype) -> None:
    from prefixcache.model.layers import choose_gemm

    onednn, panel = choose_gemm(linear.in_features, linear.out_features, dtype)
    if dtype == torch.float32:
        linear.weight.data = linear.weight.data.t().contiguous().t()
    linear.pack(True, onednn, panel)


def _from_dict(data: dict[str, Any], reason: str) -> Choice | None:
    try:
        return Choice(Precision.parse(data["chosen"]), data["candidates"], data["cpu"], reason)
    except (KeyError, TypeError, AttributeError):
        return None
