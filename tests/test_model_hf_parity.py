"""Our paged decoder equals transformers' logits (float32, 1e-4) for each supported family.

Checkpoints are created here with transformers and saved to a temp dir (no download); each
case runs a 200-token prompt whole, with 160 tokens served from the paged cache, in 3 chunks,
and in a mixed batch, always with block size 16 and shuffled physical block ids.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from prefixcache.attention import AttentionMetadata, PagedKVCache
from prefixcache.model import load_model, tuning
from prefixcache.model.byte_tokenizer import write_byte_tokenizer

BLOCK_SIZE = 16
NUM_BLOCKS = 64
PROMPT_LEN = 200
TOL = 1e-4

_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=1024,
)

CASES = {
    "llama_gqa_untied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False),
    ),
    "qwen2_bias_tied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    "qwen3_qknorm_headdim": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32, tie_word_embeddings=False),
    ),
    "llama3_rope_scaling": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=None),
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (transformers zero-inits biases, one-inits norms)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)


# every test through the compiled kernel and through the torch paths (conftest.py)
pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    config_cls, model_cls, extra = CASES[request.param]
    config = config_cls(**_SMALL, **extra)
    hf_model = model_cls(config).eval()
    _randomize(hf_model, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    write_byte_tokenizer(path)
    prompt = torch.randint(
        0, _SMALL["vocab_size"], (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        hf_logits = hf_model(prompt.unsqueeze(0)).logits[0]  # [PROMPT_LEN, vocab]
    return load_model(str(path)), prompt, hf_logits


def _shuffled_table(seed: int, num_tokens: int) -> list[int]:
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return ids[: -(-num_tokens // BLOCK_SIZE)]


def _new_cache(loaded) -> PagedKVCache:  # noqa: ANN001
    c = loaded.config
    return PagedKVCache(
        c.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim
    )


def _run_chunks(loaded, prompt, chunk_sizes, table, cache) -> list[torch.Tensor]:  # noqa: ANN001
    """Feed the prompt in chunks through the paged cache; logits after each chunk."""
    outputs, done = [], 0
    for size in chunk_sizes:
        meta = AttentionMetadata.build([table], [done], [size], BLOCK_SIZE)
        outputs.append(loaded.model(prompt[done : done + size], meta.positions, cache, meta)[0])
        done += size
    return outputs


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < TOL, f"max |ours - transformers| = {err:.2e}"


def test_full_prompt_matches(case) -> None:  # noqa: ANN001
    loaded, prompt, hf_logits = case
    table = _shuffled_table(1, PROMPT_LEN)
    (logits,) = _run_chunks(loaded, prompt, [PROMPT_LEN], table, _new_cache(loaded))
    _assert_close(logits, hf_logits[-1])


def test_full_prompt_matches_with_the_mlp_in_row_chunks(case, monkeypatch) -> None:  # noqa: ANN001
    # long prefills run the MLP in chunks of MLP_CHUNK_ROWS tokens; 200 tokens in chunks of 48
    monkeypatch.setattr(tuning, "MLP_CHUNK_ROWS", 48)
    loaded, prompt, hf_logits = case
    table = _shuffled_table(4, PROMPT_LEN)
    (logits,) = _run_chunks(loaded, prompt, [PROMPT_LEN], table, _new_cache(loaded))
    _assert_close(logits, hf_logits[-1])


def test_cached_prefix_matches(case) -> None:  # noqa: ANN001
    loaded, prompt, hf_logits = case
    table = _shuffled_table(2, PROMPT_LEN)
    first, last = _run_chunks(loaded, prompt, [160, 40], table, _new_cache(loaded))
    _assert_close(first, hf_logits[159])
    _assert_close(last, hf_logits[-1])


def test_three_chunks_match(case) -> None:  # noqa: ANN001
    loaded, prompt, hf_logits = case
    table = _shuffled_table(3, PROMPT_LEN)
    outs = _run_chunks(loaded, prompt, [70, 65, 65], table, _new_cache(loaded))
    for logits, position in zip(outs, (69, 134, 199), strict=True):
        _assert_close(logits, hf_logits[position])


def test_mixed_batch_matches(case) -> None:  # noqa: ANN001
    """One step holding a decode token, a cached-prefix prefill and a fresh prefill."""
    loaded, prompt, hf_logits = case
    cache = _new_cache(loaded)
    ids = list(range(NUM_BLOCKS))
    random.Random(4).shuffle(ids)
    tables = [ids[0:13], ids[13:26], ids[26:39]]
    _run_chunks(loaded, prompt, [199], tables[0], cache)
    _run_chunks(loaded, prompt, [150], tables[1], cache)
    meta = AttentionMetadata.build(tables, [199, 150, 0], [1, 50, 120], BLOCK_SIZE)
    input_ids = torch.cat([prompt[199:200], prompt[150:200], prompt[:120]])
    logits = loaded.model(input_ids, meta.positions, cache, meta)
    for row, position in enumerate((199, 199, 119)):
        _assert_close(logits[row], hf_logits[position])
