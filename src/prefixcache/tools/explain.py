"""`prefixcache explain A B`: why prompt B does (not) reuse prompt A's cached prefix.

Both prompts go through the production tokenizer and chat template, then through the real block
identity (`cache/block_hash.py`) in their namespaces. The report gives the common token prefix, the
reusable blocks and tokens, the first missing block with its token span, and the reason: a
namespace component differs (model identity, adapter, salt, KV layout: named, never printed) or
the tokens differ (the position; the ids and decoded pieces around it only with
``--show-tokens``). With a lower tier named, it says which of B's blocks the tier holds, and
where the tier holds them only in another KV layout, that they are a miss for that reason.

With ``--public-prefix`` (a declared public prefix, in the same forms as the prompts; with
``--chat`` its messages render without the generation prompt, as the server renders a
declared ``system``), the whole blocks a prompt shares with it chain from the public namespace
for the sides ``--public-for`` names (the tenants the declaration lists), and the report says how
much of the reusable part is public and how much is B's own.

A LoRA adapter (``--adapter-a`` / ``--adapter-b``) is named in the namespace by its content, as
the engine names it: give its directory (its files are read and digested) or its identity.

This module reads prompts and tokenizers; it never loads model weights and never touches a cache.
"""

from __future__ import annotations

import argparse
import json
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.cache.block_hash import HASH_ALGOS, BlockHasher, Namespace
from prefixcache.cache.public import PublicPrefixes
from prefixcache.cache.sequence import Sequence as CacheSequence
from prefixcache.catalog import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    WEIGHT_DTYPE_CHOICES,
    model_help,
)
from prefixcache.errors import CliError

__all__ = [
    "Explanation",
    "ModelView",
    "Prompt",
    "explain",
    "format_explanation",
    "load_model_view",
    "read_prompt",
    "text_warnings",
]

TOKEN_WINDOW = 4  # tokens shown on each side of the divergence with --show-tokens


@dataclass(slots=True)
class Prompt:
    """One side of the comparison: its token ids and, when it was text, the text."""

    token_ids: list[int]
    text: str | None = None
    kind: str = "text"  # text | tokens | chat


@dataclass(slots=True)
class ModelView:
    """What explain needs of a model: its cache identity and its tokenizer (may be None)."""

    identity: str
    tokenizer: Any = None
    config: Any = None  # the model's config (the KV layout, for the tiers' identity)
    dtype: str = "float32"  # of the activations
    precision: str = "float32"  # dtype, or dtype+weights where the weights are kept otherwise
    choice: Any = None  # what --dtype auto measured (`prefixcache.model.precision.Choice`)
    kv_cache_dtype: str = ""  # the KV layout's name ("": the activations' dtype)

    @property
    def kv_format(self) -> Any:
        """The KV layout (`prefixcache.attention.kv_format.KVFormat`)."""
        from prefixcache.attention.kv_format import format_of_dtype, kv_format
        from prefixcache.model.loader import DTYPES

        if self.kv_cache_dtype:
            return kv_format(self.kv_cache_dtype)
        return format_of_dtype(DTYPES[self.dtype])

    @property
    def kv_layout(self) -> str | None:
        """What the cache namespace names of the KV layout (None: the activations' dtype)."""
        from prefixcache.attention.kv_format import format_of_dtype
        from prefixcache.model.loader import DTYPES

        found = self.kv_format
        return None if found == format_of_dtype(DTYPES[self.dtype]) else found.layout

    def kernels(self) -> dict[str, Any]:
        """Which GEMM and attention path an engine would run this model with here, and whether
        a row's result is batch invariant (`prefixcache.model.decoder.expected_kernels`)."""
        from prefixcache.model.decoder import expected_kernels
        from prefixcache.model.loader import DTYPES

        weights = self.precision.partition("+")[2] or self.dtype
        from prefixcache.model.fused_layers import QUANTIZED_KV_WRITTEN

        layout = self.kv_format
        written = layout.storage == DTYPES[self.dtype] or layout.name in QUANTIZED_KV_WRITTEN
        kv = None if written else layout.name
        return expected_kernels(self.config, DTYPES[self.dtype], weights, kv)


@dataclass(slots=True)
class Explanation:
    """The diagnosis. ``first_miss_block`` is None when B's every complete block is reusable."""

    block_size: int
    num_tokens_a: int
    num_tokens_b: int
    common_prefix_tokens: int
    reusable_blocks: int
    reusable_tokens: int
    usable_tokens: int  # what a request B would actually get: capped at len(B) - 1
    first_miss_block: int | None
    first_miss_span: tuple[int, int] | None
    reason: str  # namespace | tokens | a_shorter | none
    namespace_diff: list[str] = field(default_factory=list)
    divergence_position: int | None = None
    warnings: list[str] = field(default_factory=list)
    public_blocks_b: int = 0  # B's leading blocks in the public namespace
    reusable_public_blocks: int = 0  # of the reusable blocks, the public ones

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["first_miss_span"] = list(self.first_miss_span) if self.first_miss_span else None
        return out


# ---- input ------------------------------------------------------------------------------------


def read_source(arg: str) -> str:
    """``@path`` or an existing file path -> its text; anything else is the text itself."""
    path = Path(arg[1:]) if arg.startswith("@") else Path(arg)
    if arg.startswith("@") or _is_file(path):
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read {path}: {exc}") from None
    return arg


def _is_file(path: Path) -> bool:
    try:
        return len(str(path)) < 4096 and path.is_file()
    except OSError:
        return False


def _json_or_none(text: str) -> Any:
    stripped = text.strip()
    if not stripped.startswith(("[", "{")):
        return None
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        return None


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def read_prompt(arg: str, tokenizer: Any, chat: bool = False,
                add_generation_prompt: bool = True) -> Prompt:  # fmt: skip
    """Text, a file, a JSON token-id list or (``chat``) JSON chat messages -> token ids."""
    text = read_source(arg)
    value = _json_or_none(text)
    if _is_token_list(value):
        return Prompt(_check_ids(value), None, "tokens")
    if chat:
        return _chat_prompt(value, tokenizer, add_generation_prompt)
    if tokenizer is None:
        raise CliError("a text prompt needs a tokenizer (this model has none)")
    return Prompt(list(tokenizer.encode(text)), text, "text")


def _check_ids(ids: list[int]) -> list[int]:
    bad = [t for t in ids if not 0 <= t < 2**32]
    if bad:
        raise CliError(f"token id {bad[0]} is out of range [0, 2**32)")
    return list(ids)


def read_public_prefix(arg: str, tokenizer: Any, chat: bool = False) -> Prompt:
    """A declared public prefix: like a prompt, but a chat one renders without the generation
    prompt (a system message the conversations start with)."""
    return read_prompt(arg, tokenizer, chat, add_generation_prompt=False)


def _chat_prompt(value: Any, tokenizer: Any, add_generation_prompt: bool = True) -> Prompt:
    messages = value.get("messages") if isinstance(value, dict) else value
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise CliError('--chat expects a JSON list of messages (or {"messages": [...]})')
    if tokenizer is None:
        raise CliError("--chat needs a tokenizer with a chat template")
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template's own errors (unknown role, missing field, ...)
        raise CliError(f"chat template failed: {exc}") from None
    return Prompt(list(tokenizer.encode(text, add_special_tokens=False)), text, "chat")


# ---- diagnosis --------------------------------------------------------------------------------


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def namespace_diff(a: Namespace, b: Namespace) -> list[str]:
    """The names (never the values) of the namespace components that differ."""
    names = {"model": "model identity", "adapter": "adapter", "salt": "cache salt",
             "kv_layout": "KV layout"}
    return [label for attr, label in names.items() if getattr(a, attr) != getattr(b, attr)]


def explain(
    a: Prompt,
    b: Prompt,
    ns_a: Namespace,
    ns_b: Namespace,
    block_size: int = 16,
    hash_algo: str = "sha256",
    public: tuple[int, int] = (0, 0),
) -> Explanation:
    """Diagnose how much of B's prompt a cache holding A's prompt could serve, and why not more.
    ``public``: A's and B's leading blocks in the public namespace (`public_blocks`)."""
    hasher = BlockHasher(block_size, hash_algo)
    chain_a = block_chain(hasher, a.token_ids, ns_a, public[0])
    chain_b = block_chain(hasher, b.token_ids, ns_b, public[1])
    reusable = common_prefix(chain_a, chain_b)
    common = common_prefix(a.token_ids, b.token_ids)
    usable = min(reusable, max(len(b.token_ids) - 1, 0) // block_size) * block_size
    diff = namespace_diff(ns_a, ns_b)
    miss = reusable if reusable < len(chain_b) else None
    out = Explanation(
        block_size=block_size,
        num_tokens_a=len(a.token_ids),
        num_tokens_b=len(b.token_ids),
        common_prefix_tokens=common,
        reusable_blocks=reusable,
        reusable_tokens=reusable * block_size,
        usable_tokens=usable,
        first_miss_block=miss,
        first_miss_span=None if miss is None else (miss * block_size, (miss + 1) * block_size),
        reason=_reason(miss, diff, common, len(a.token_ids)),
        namespace_diff=diff,
        public_blocks_b=public[1],
        reusable_public_blocks=min(reusable, public[1]),
    )
    if out.reason == "tokens":
        out.divergence_position = common
    out.warnings = text_warnings(a, b)
    return out


def block_chain(hasher: BlockHasher, token_ids: list[int], ns: Namespace,
                num_public: int = 0) -> list[bytes]:  # fmt: skip
    """The digests a cache gives ``token_ids`` in ``ns``, its first ``num_public`` blocks in
    the public namespace."""
    seq = CacheSequence("explain", token_ids, ns.salt, adapter=ns.adapter, copy=False,
                        public_blocks=num_public)
    return list(seq.digests(hasher, ns.model, ns.kv_layout))


def public_blocks(prefix: Prompt | None, prompts: tuple[Prompt, Prompt], sides: str,
                  block_size: int) -> tuple[int, int]:  # fmt: skip
    """A's and B's public blocks under the declared ``prefix`` (for the ``sides`` it names:
    ``a``, ``b`` or ``both``)."""
    if prefix is None:
        return 0, 0
    declared = PublicPrefixes({"prefix": prefix.token_ids})
    a, b = (declared.num_public_blocks(p.token_ids, ["prefix"], block_size)
            if sides in (side, "both") else 0
            for side, p in zip("ab", prompts, strict=True))  # fmt: skip
    return a, b


def _reason(miss: int | None, diff: list[str], common: int, num_tokens_a: int) -> str:
    if miss is None:
        return "none"
    if diff:
        return "namespace"
    if common >= num_tokens_a:
        return "a_shorter"
    return "tokens"


def text_warnings(a: Prompt, b: Prompt) -> list[str]:
    """Texts that look alike but tokenize differently (or the reverse)."""
    if a.text is None or b.text is None:
        return []
    same_tokens = a.token_ids == b.token_ids
    if a.text == b.text:
        return [] if same_tokens else ["the texts are equal but their tokens differ"]
    look_alike = _look_alike(a.text, b.text)
    out = [look_alike] if look_alike else []
    if same_tokens:
        out.append("the texts differ but their tokens are equal")
    return out


def _look_alike(x: str, y: str) -> str | None:
    for form in ("NFC", "NFKC"):
        if unicodedata.normalize(form, x) == unicodedata.normalize(form, y):
            return f"the texts differ only in Unicode normalization (equal after {form})"
    if "".join(x.split()) == "".join(y.split()):
        return "the texts differ only in whitespace"
    return None


# ---- report -----------------------------------------------------------------------------------


def format_explanation(
    ex: Explanation, a: Prompt, b: Prompt, tokenizer: Any = None, show_tokens: bool = False
) -> list[str]:
    """Human-readable report lines."""
    lines = [
        f"tokens: A={ex.num_tokens_a} B={ex.num_tokens_b}  block size {ex.block_size}",
        f"common token prefix: {ex.common_prefix_tokens} tokens",
        f"reusable: {ex.reusable_blocks} blocks = {ex.reusable_tokens} tokens"
        f" (a request B would hit {ex.usable_tokens}: one prompt token is always computed)",
    ]
    if ex.public_blocks_b:
        own = ex.reusable_blocks - ex.reusable_public_blocks
        lines.append(f"public: B's first {ex.public_blocks_b} blocks are a declared public "
                     f"prefix's; of the reusable blocks {ex.reusable_public_blocks} are public "
                     f"and {own} B's own")
    lines.extend(_miss_lines(ex))
    if show_tokens and ex.divergence_position is not None:
        lines.extend(token_window(a.token_ids, b.token_ids, ex.divergence_position, tokenizer))
    lines.extend(f"warning: {w}" for w in ex.warnings)
    return lines


def _miss_lines(ex: Explanation) -> list[str]:
    if ex.first_miss_block is None or ex.first_miss_span is None:
        return ["first miss: none (every complete block of B is reusable)"]
    start, end = ex.first_miss_span
    head = f"first miss: block {ex.first_miss_block}, tokens [{start}, {end})"
    if ex.reason == "namespace":
        return [head, f"why: the namespace differs: {', '.join(ex.namespace_diff)}"]
    if ex.reason == "a_shorter":
        return [head, f"why: A ends at token {ex.num_tokens_a}; B continues past it"]
    pos = ex.divergence_position if ex.divergence_position is not None else start
    return [head, f"why: the tokens differ at position {pos} (offset {pos - start} in the block)"]


def token_window(a: Sequence[int], b: Sequence[int], pos: int, tokenizer: Any = None) -> list[str]:
    """Token ids and decoded pieces around ``pos`` on both sides."""
    lo, hi = max(pos - TOKEN_WINDOW, 0), pos + TOKEN_WINDOW + 1
    lines = [f"tokens [{lo}, {hi}) around position {pos}:"]
    for label, ids in (("A", a), ("B", b)):
        cells = [_token_cell(i, ids[i], tokenizer, i == pos) for i in range(lo, min(hi, len(ids)))]
        lines.append(f"  {label}: " + " ".join(cells))
    return lines


def _token_cell(index: int, token_id: int, tokenizer: Any, mark: bool) -> str:
    piece = ""
    if tokenizer is not None:
        try:
            piece = "=" + repr(tokenizer.decode([token_id], skip_special_tokens=False))
        except Exception:  # an id outside the vocabulary: show the id alone
            piece = "=?"
    cell = f"{token_id}{piece}"
    return f">>{cell}<<" if mark else cell


# ---- models and the command -------------------------------------------------------------------


def load_model_view(
    name: str, dtype: str = "float32", weight_dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> ModelView:
    """The model's cache identity (as the engine computes it: ``--dtype auto`` and
    ``--kv-cache-dtype auto`` resolved by the same measurements, read from their cache after
    the first time) and tokenizer, without weights."""
    from prefixcache.model.loader import open_checkpoint, resolve_kv_format, resolve_precision

    try:
        checkpoint = open_checkpoint(name)
        measured = dtype == "auto"
        dtype, weights, choice = resolve_precision(checkpoint, dtype, weight_dtype)
        layout, _ = resolve_kv_format(checkpoint, kv_cache_dtype, dtype, weights,
                                      measured and choice is not None)  # fmt: skip
        precision = dtype if weights == dtype else f"{dtype}+{weights}"
        return ModelView(checkpoint.identity(precision), checkpoint.tokenizer(),
                         checkpoint.config, dtype, precision, choice,
                         layout.name if layout is not None else "")  # fmt: skip
    except (ValueError, OSError) as exc:
        raise CliError(f"cannot load model {name!r}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="prompt A: text, @file, a file path, or a JSON token-id list")
    parser.add_argument("b", help="prompt B (same forms as A)")
    parser.add_argument("--model", default="tiny", help=model_help("tiny"))
    parser.add_argument("--model-b", default=None, help="a different model for B")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype the engine runs (identity; auto: as serve measures it)")
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPE_CHOICES,
                        help="how the engine keeps its weights (identity), as serve's flag")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="how the engine keeps its KV cache (identity), as serve's flag")
    parser.add_argument("--kv-cache-dtype-b", default=None, choices=KV_CACHE_DTYPE_CHOICES,
                        help="another KV layout for B (default: --kv-cache-dtype)")
    parser.add_argument("--salt-a", default=None, help="effective cache salt of A")
    parser.add_argument("--salt-b", default=None, help="effective cache salt of B")
    parser.add_argument("--adapter-a", default=None, metavar="DIR|IDENTITY",
                        help="A's LoRA adapter: its directory (named by its content, as the "
                             "engine names it) or its identity")
    parser.add_argument("--adapter-b", default=None, metavar="DIR|IDENTITY",
                        help="B's LoRA adapter (as --adapter-a)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--hash-algo", default="sha256", choices=sorted(HASH_ALGOS))
    parser.add_argument("--chat", action="store_true", help="A and B are JSON chat messages")
    parser.add_argument("--public-prefix", default=None, metavar="PROMPT",
                        help="a declared public prefix (same forms as A and B; with --chat, "
                             "messages rendered without the generation prompt)")
    parser.add_argument("--public-for", default="both", choices=("a", "b", "both"),
                        help="whose tenant may use --public-prefix (both)")
    parser.add_argument(
        "--show-tokens", action="store_true", help="print token ids and pieces at the divergence"
    )
    from prefixcache.tiers import TIERS

    for kind in TIERS.values():
        parser.add_argument(kind.flag, metavar=kind.metavar, default=None,
                            help=f"also say which of B's blocks this {kind.name} tier holds")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1:
        raise CliError(f"--block-size must be >= 1, got {args.block_size}")
    view_a = load_model_view(args.model, args.dtype, args.weight_dtype, args.kv_cache_dtype)
    kv_b = args.kv_cache_dtype_b or args.kv_cache_dtype
    view_b = (load_model_view(args.model_b or args.model, args.dtype, args.weight_dtype, kv_b)
              if args.model_b or kv_b != args.kv_cache_dtype else view_a)  # fmt: skip
    a = read_prompt(args.a, view_a.tokenizer, args.chat)
    b = read_prompt(args.b, view_b.tokenizer, args.chat)
    ns_a = Namespace(view_a.identity, adapter_identity(args.adapter_a, view_a), args.salt_a,
                     view_a.kv_layout)
    ns_b = Namespace(view_b.identity, adapter_identity(args.adapter_b, view_b), args.salt_b,
                     view_b.kv_layout)
    prefix = (None if args.public_prefix is None
              else read_public_prefix(args.public_prefix, view_b.tokenizer, args.chat))
    public = public_blocks(prefix, (a, b), args.public_for, args.block_size)
    ex = explain(a, b, ns_a, ns_b, args.block_size, args.hash_algo, public)
    tiers = None
    locations = tier_locations(args)
    if locations:
        chain = block_chain(BlockHasher(args.block_size, args.hash_algo), b.token_ids, ns_b,
                            public[1])
        chain = chain[: max(len(b.token_ids) - 1, 0) // args.block_size]
        tiers = tier_residence(view_b, chain, args.block_size, args.hash_algo, locations)
        others = other_layouts(view_b, b.token_ids, ns_b, args.block_size, args.hash_algo,
                               locations)
    precision: dict[str, Any] = {"precision": view_b.precision, "kernels": view_b.kernels(),
                                 "kv_cache_dtype": view_b.kv_format.name}
    if view_b.choice is not None:
        precision["dtype_auto"] = view_b.choice.as_dict()
    if args.json:
        print(json.dumps(ex.as_dict() | {"model": precision}
                         | ({"tiers": tiers, "tiers_other_layouts": others}
                            if tiers is not None else {})))  # fmt: skip
        return 0
    for line in format_explanation(ex, a, b, view_b.tokenizer, args.show_tokens):
        print(line)
    print(f"model precision: {view_b.precision}"
          + (f" ({view_b.choice.describe()})" if view_b.choice is not None else ""))
    kernels = precision["kernels"]
    print(f"kernels: {kernels['gemm']}; {kernels['attention']} attention; a row's result "
          + ("does not depend" if kernels["batch_invariant"] else "may depend")
          + " on the rest of its batch; layers: " + str(kernels.get("layers", "compiled")))
    print(f"KV cache: {view_b.kv_format.name}")
    if tiers is not None:
        print(*tier_lines(ex, tiers), sep="\n")
        print(*layout_lines(others, view_b.kv_format.name), sep="\n")
    return 0


def adapter_identity(value: str | None, view: ModelView) -> str | None:
    """The namespace's adapter: a directory's adapter named by its content (its files checked
    against the model), else ``value`` as given (an identity)."""
    if value is None or not Path(value).is_dir():
        return value
    from prefixcache.model.lora import LoraError, load_adapter

    try:
        return load_adapter(value, view.config).identity
    except LoraError as exc:
        raise CliError(f"adapter {value}: {exc}") from None


def tier_locations(args: argparse.Namespace) -> dict[str, str]:
    """The tiers named on the command line, nearest first: name -> location."""
    from prefixcache.tiers import TIERS

    return {kind.name: location for kind in TIERS.values()
            if (location := getattr(args, kind.dest, None))}  # fmt: skip


def tier_residence(
    view: ModelView, chain: list[bytes], block_size: int, hash_algo: str,
    locations: dict[str, str],
) -> dict[str, list[bool]]:  # fmt: skip
    """Per lower tier (``locations``: name -> where it is), which of B's blocks (``chain``,
    those a request could reuse) it holds, under the identity an engine serving ``view`` would
    write them with."""
    from prefixcache.tiers import TIERS

    identity = _tier_identity(view, view.kv_format, block_size, hash_algo)
    return {name: TIERS[name].held(location, identity, chain)
            for name, location in locations.items()}


def _tier_identity(view: ModelView, layout: Any, block_size: int, hash_algo: str) -> Any:
    """The `TierIdentity` an engine serving ``view`` with the KV in ``layout`` writes under
    (the fields of the engine's own `tier_identity`)."""
    from prefixcache.tiers import TierIdentity

    config = view.config
    return TierIdentity(view.identity, layout.name, config.num_hidden_layers,
                        config.num_key_value_heads, config.head_dim, block_size, hash_algo,
                        layout.storage.itemsize, layout.layout if layout.quantized else "",
                        layout.row_bytes(config.head_dim) if layout.quantized else 0)


def other_layouts(
    view: ModelView, token_ids: list[int], namespace: Namespace, block_size: int,
    hash_algo: str, locations: dict[str, str],
) -> dict[str, dict[str, int]]:  # fmt: skip
    """Per lower tier, how many of B's reusable blocks it holds in each other KV layout the
    model could keep (under that layout's namespace and identity): blocks an engine in
    ``view``'s layout will not read ("KV layout differs")."""
    from dataclasses import replace

    from prefixcache.attention.kv_format import FORMATS, format_of_dtype
    from prefixcache.model.loader import DTYPES
    from prefixcache.tiers import TIERS

    own, base = view.kv_format, format_of_dtype(DTYPES[view.dtype])
    hasher = BlockHasher(block_size, hash_algo)
    usable = max(len(token_ids) - 1, 0) // block_size
    out: dict[str, dict[str, int]] = {name: {} for name in locations}
    for layout in FORMATS.values():
        if layout == own or (not layout.quantized and layout.storage.itemsize
                             > base.storage.itemsize):
            continue  # the engine's own layout, or one wider than its activations
        try:
            layout.check_head_dim(view.config.head_dim)
        except ValueError:
            continue
        ns = replace(namespace, kv_layout=None if layout == base else layout.layout)
        chain = hasher.chain(token_ids, ns)[:usable]
        identity = _tier_identity(view, layout, block_size, hash_algo)
        for name, location in locations.items():
            held = sum(TIERS[name].held(location, identity, chain))
            if held:
                out[name][layout.name] = held
    return out


def layout_lines(others: dict[str, dict[str, int]], own: str) -> list[str]:
    """What the tiers hold of B in other KV layouts: a miss, and why."""
    return [f"{name} tier: holds {n} of B's blocks in the {layout} KV layout, which this "
            f"engine ({own}) does not read: KV layout differs (a miss)"
            for name, held in others.items() for layout, n in held.items()]  # fmt: skip


def tier_lines(ex: Explanation, tiers: dict[str, list[bool]]) -> list[str]:
    """Where each of B's reusable blocks would come from: A's RAM prefix, then the tiers'
    longest run after it (nearest tier first), else computed."""
    num = len(next(iter(tiers.values()), []))
    source = []
    for i in range(num):
        if i < ex.usable_tokens // ex.block_size:
            source.append("ram")
            continue
        found = next((name for name, held in tiers.items() if held[i]), None)
        if found is None or (source and source[-1] == "computed"):
            found = "computed"
        source.append(found)
    lines = []
    for name, held in tiers.items():
        lines.append(f"{name} tier: holds {sum(held)} of B's {num} reusable blocks")
    runs: list[tuple[str, int, int]] = []
    for i, name in enumerate(source):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], i + 1)
        else:
            runs.append((name, i, i + 1))
    for name, start, end in runs:
        what = "from A's RAM cache" if name == "ram" else (
            "computed" if name == "computed" else f"loaded from the {name} tier")
        lines.append(f"  blocks {start}-{end - 1}: {what}")
    return lines
