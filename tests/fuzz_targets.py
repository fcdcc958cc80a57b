"""Fuzz targets: every reader of a file a user hands us, fed arbitrary bytes.

Each `Target` writes the bytes where its reader looks (a ``.gguf`` file, a checkpoint directory's
``model.safetensors`` or ``tokenizer.json``, a chat template, a tenants or secret file, a trace in
each format) and calls the reader as the server and the CLI do. The reader may accept the input
or refuse it with its own error type (`GGUFError`, `TokenizerError`, `TenancyError`, ...), whose
message names the file; anything else escaping is a crash. The seeds are small valid files, so a
fuzzer starts from inputs that reach deep into each reader.

Used by tests/test_fuzz_readers.py (hypothesis: mutated seeds, in the suite) and
tests/fuzz_atheris.py (coverage-guided, for longer runs); inputs that once crashed are kept in
tests/fuzz_corpus/<target>/ and replayed by the suite.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CORPUS = Path(__file__).parent / "fuzz_corpus"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes, Path], None]  # the input, a fresh directory to write it in
    expected: tuple[type[BaseException], ...]  # the reader's own refusals
    seeds: Callable[[], list[bytes]]
    names_file: bool = True  # the refusal's message names the file

    def check(self, data: bytes) -> None:
        """Run one input; raise AssertionError for a crash (an unexpected exception) or a
        refusal that does not say which file it is about."""
        with tempfile.TemporaryDirectory(prefix=f"fuzz-{self.name}-") as work:
            try:
                self.run(data, Path(work))
            except self.expected as exc:
                if self.names_file:
                    assert _FILE_NAMES[self.name] in str(exc), f"{self.name}: {exc!r}"
            except RecursionError:  # a crash, but not one worth a 10,000-frame report
                raise AssertionError(f"{self.name}: RecursionError") from None
            except Exception as exc:
                raise AssertionError(f"{self.name}: crashed with {exc!r}") from exc


_FILE_NAMES = {"gguf": "model.gguf", "safetensors": "model.safetensors",
               "tokenizer": "tokenizer.json", "chat_template": "chat template",
               "tenants": "tenants.toml", "secret": "secret", "mooncake": "trace.jsonl",
               "record": "trace.jsonl", "agentic": "trace.json"}


# -- model files --------------------------------------------------------------------------------

@cache
def _tiny_hf_model() -> object:
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=259, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@cache
def _gguf_seed() -> bytes:
    from gguf_helpers import write_gguf

    with tempfile.TemporaryDirectory() as work:
        return write_gguf(Path(work) / "seed.gguf", _tiny_hf_model(), "llama", "Q8_0").read_bytes()


def _run_gguf(data: bytes, work: Path) -> None:
    from prefixcache.model.loader import load_model

    path = work / "model.gguf"
    path.write_bytes(data)
    loaded = load_model(str(path), pack_weights=False)
    loaded.tokenizer.encode("fuzzing the reader")


@cache
def _checkpoint_seed() -> dict[str, bytes]:
    """A checkpoint directory's files (config, tokenizer, weights) from the tiny model."""
    from gguf_helpers import write_gguf
    from prefixcache.model.gguf_checkpoint import GGUFCheckpoint, convert_to_directory

    with tempfile.TemporaryDirectory() as work:
        gguf = write_gguf(Path(work) / "seed.gguf", _tiny_hf_model(), "llama", "F32")
        target = Path(work) / "dir"
        target.mkdir()
        convert_to_directory(GGUFCheckpoint(gguf), target, "fuzz-seed")
        _tiny_hf_model().save_pretrained(target / "hf", safe_serialization=True)
        files = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
        files["model.safetensors"] = (target / "hf" / "model.safetensors").read_bytes()
        return files


def _write_checkpoint(work: Path, replaced: str, data: bytes) -> Path:
    directory = work / "checkpoint"
    directory.mkdir()
    for name, content in _checkpoint_seed().items():
        (directory / name).write_bytes(data if name == replaced else content)
    return directory


def _run_safetensors(data: bytes, work: Path) -> None:
    from prefixcache.model.loader import load_model

    load_model(str(_write_checkpoint(work, "model.safetensors", data)), pack_weights=False)


def _run_tokenizer(data: bytes, work: Path) -> None:
    from prefixcache.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(_write_checkpoint(work, "tokenizer.json", data))
    ids = tokenizer.encode("fuzzing the reader <|im_end|>")
    tokenizer.decode(ids)


# -- chat templates -----------------------------------------------------------------------------

def _run_chat_template(data: bytes, work: Path) -> None:
    from prefixcache.model.chat_template import ChatTemplateError, render_chat

    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ChatTemplateError("the chat template is not UTF-8 text") from None
    render_chat(source, MESSAGES, True, {"bos_token": "<s>", "eos_token": "</s>"})


def _template_seeds() -> list[bytes]:
    from gguf_helpers import CHATML

    return [CHATML.encode(), _checkpoint_seed().get("chat_template.jinja", b"") or
            json.loads(_checkpoint_seed()["tokenizer_config.json"]).get(
                "chat_template", "").encode()]


# -- tenants and secrets ------------------------------------------------------------------------

def _run_tenants(data: bytes, work: Path) -> None:
    from prefixcache.server.tenancy import TenantRegistry, load_tenants

    path = work / "tenants.toml"
    path.write_bytes(data)
    by_key = load_tenants(path)
    registry = TenantRegistry(by_key, b"fuzz-secret-0123456789abcdef")
    for key in list(by_key)[:4]:
        registry.authenticate(key)


def _run_secret(data: bytes, work: Path) -> None:
    from prefixcache.server.tenancy import load_secret

    path = work / "secret"
    path.write_bytes(data)
    load_secret(str(path))


# -- traces -------------------------------------------------------------------------------------

def _trace_runner(fmt: str, file_name: str) -> Callable[[bytes, Path], None]:
    def run(data: bytes, work: Path) -> None:
        from prefixcache.sim.loader import load_trace

        path = work / file_name
        path.write_bytes(data)
        load_trace(str(path), fmt)

    return run


def _shared_trace(*parts: str) -> bytes:
    for root in (Path(__file__).parents[2] / "shared", Path("/work/shared")):
        path = root.joinpath("traces", *parts)
        if path.is_file():
            return path.read_bytes()[:4096]
    return b""


def _mooncake_seeds() -> list[bytes]:
    lines = [json.dumps({"timestamp": 27 * i, "input_length": 1000 + i, "output_length": 20,
                         "hash_ids": [0, 1, 2 + i]}) for i in range(4)]
    lines.append(json.dumps({"timestamp": 200, "input_length": 600, "output_length": 4,
                             "hash_ids": [0, 1], "tenant": "a",
                             "cache_control": [{"block": 1, "ttl": "1h"}]}))
    shared = _shared_trace("mooncake", "conversation_trace.jsonl")
    return ["\n".join(lines).encode()] + ([shared.rsplit(b"\n", 1)[0]] if shared else [])


def _record_seeds() -> list[bytes]:
    from prefixcache.sim.record import FORMAT_NAME

    header = {"format": FORMAT_NAME, "version": 1, "block_size": 16}
    rows = [{"t": 0.5 * i, "input_length": 40, "output_length": 4, "tenant": "a",
             "block_digests": ["ab" * 8, f"{i:02x}" * 8]} for i in range(3)]
    return ["\n".join(json.dumps(r) for r in [header, *rows]).encode()]


def _agentic_seeds() -> list[bytes]:
    convo = {"id": "c1", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 900, "out": 12, "hash_ids": [1, 2, 3]},
        {"t": 2.0, "type": "s", "in": 1000, "out": 30, "hash_ids": [1, 2, 3, 4]}]}
    return [json.dumps(convo).encode()]


def _errors() -> dict[str, tuple[type[BaseException], ...]]:
    from prefixcache.model.chat_template import ChatTemplateError
    from prefixcache.model.config import ConfigError
    from prefixcache.model.gguf_checkpoint import GGUFError
    from prefixcache.model.loader import ModelLoadError
    from prefixcache.model.tokenizer import TokenizerError
    from prefixcache.model.weights import WeightLoadError
    from prefixcache.server.tenancy import TenancyError
    from prefixcache.sim.errors import TraceFormatError

    model = (GGUFError, ConfigError, ModelLoadError, TokenizerError, WeightLoadError)
    return {"model": model, "template": (ChatTemplateError,), "tenancy": (TenancyError,),
            "trace": (TraceFormatError,)}


@cache
def targets() -> dict[str, Target]:
    errors = _errors()
    found = [
        Target("gguf", _run_gguf, errors["model"], lambda: [_gguf_seed()]),
        Target("safetensors", _run_safetensors, errors["model"],
               lambda: [_checkpoint_seed()["model.safetensors"]]),
        Target("tokenizer", _run_tokenizer, errors["model"],
               lambda: [_checkpoint_seed()["tokenizer.json"]]),
        Target("chat_template", _run_chat_template, errors["template"], _template_seeds),
        Target("tenants", _run_tenants, errors["tenancy"], lambda: [
            (Path(__file__).parents[1] / "examples" / "tenants.toml").read_bytes()]),
        Target("secret", _run_secret, errors["tenancy"],
               lambda: [b"0123456789abcdef0123456789abcdef\n"]),
        Target("mooncake", _trace_runner("mooncake", "trace.jsonl"), errors["trace"],
               _mooncake_seeds),
        Target("record", _trace_runner("record", "trace.jsonl"), errors["trace"], _record_seeds),
        Target("agentic", _trace_runner("agentic", "trace.json"), errors["trace"],
               _agentic_seeds),
    ]
    return {t.name: t for t in found}


def corpus(name: str) -> list[Path]:
    """The kept inputs of target ``name`` (once crashers, now regression cases)."""
    folder = CORPUS / name
    return sorted(folder.iterdir()) if folder.is_dir() else []
