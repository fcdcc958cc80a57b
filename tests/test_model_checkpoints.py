"""Checkpoints as they come: a config without ``architectures``, an embedding padded past the
tokenizer, eos lists, a ``chat_template.jinja``, bfloat16 files served as float32 or bfloat16;
and a failure inside a step that ends one request without touching the others.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys

import openai
import pytest
import torch
import transformers

from prefixcache import LLM, SamplingParams
from prefixcache.engine import output_processor
from prefixcache.model import load_model
from prefixcache.model.byte_tokenizer import write_byte_tokenizer
from prefixcache.model.tokenizer import Tokenizer
from server_harness import start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _save(path, config_cls, model_cls, dtype=torch.float32, vocab_size=264, **extra):  # noqa: ANN001, ANN003
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=vocab_size, **_SHAPE, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.05 if "norm" in name else 0.2)
    model.to(dtype).save_pretrained(path)
    write_byte_tokenizer(path)
    return model


def _last_logits_hf(model, ids):  # noqa: ANN001, ANN202
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _greedy_first(llm: LLM, prompt: str, **kw: object) -> tuple[list[int], str | None]:
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, **kw))
    return out.token_ids, out.finish_reason


def test_config_without_architectures_falls_back_to_model_type(tmp_path):
    _save(tmp_path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
    with_arch = load_model(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    without = load_model(str(tmp_path))
    assert without.config == with_arch.config
    assert without.config.architecture == "Qwen2ForCausalLM"
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "classes",
    [
        (transformers.MistralConfig, transformers.MistralForCausalLM),
        (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    ],
    ids=["mistral", "qwen2"],
)
def test_embedding_rows_past_the_tokenizer_decode_to_nothing(classes, tmp_path):
    model = _save(tmp_path, *classes, vocab_size=384)
    with torch.no_grad():  # make id 376 (no such token) the greedy choice after anything
        model.lm_head.weight[376] = model.lm_head.weight.abs().max() * 40
    model.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=16)
    assert llm.tokenizer.vocab_size == 264 < llm.engine.model_config.vocab_size == 384
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=5, temperature=0.0))
    assert 376 in out.token_ids and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode([t for t in out.token_ids if t < 264])
    assert llm.tokenizer.decode([376]) == ""


def test_generation_config_eos_list_stops_on_any_of_its_ids(tmp_path):
    _save(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    ids, reason = _greedy_first(LLM(model=str(tmp_path)), "abc", max_tokens=4)
    assert reason == "length"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [263, ids[1]]}))
    llm = LLM(model=str(tmp_path))
    assert llm.tokenizer.eos_token_ids == (263, ids[1])
    assert llm.engine.model_config.eos_token_ids == (263, ids[1])
    assert _greedy_first(llm, "abc", max_tokens=4) == (ids[:2], "stop")


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    _save(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == "[user] hi\n"
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert theirs.apply_chat_template(messages, tokenize=False) == "[user] hi\n"


def test_bfloat16_checkpoint_served_as_float32_and_bfloat16(tmp_path):
    _save(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    ids = list(range(10, 90))
    from test_model_loader import _last_logits

    def reference(dtype: torch.dtype) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype)
        return _last_logits_hf(model.eval(), ids)

    f32 = load_model(str(tmp_path), dtype="float32")
    assert (_last_logits(f32, ids) - reference(torch.float32)).abs().max() < 1e-4
    bf16 = load_model(str(tmp_path), dtype="bfloat16")
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16
    expected16 = reference(torch.bfloat16)
    scale = float(expected16.abs().max())
    assert (_last_logits(bf16, ids) - expected16).abs().max() < 0.02 * scale  # bf16: 8 bits
    cli = [sys.executable, "-m", "prefixcache", "generate", "--model", str(tmp_path)]
    done = subprocess.run([*cli, "--dtype", "bfloat16", "hi"], capture_output=True, text=True)
    assert done.returncode == 0 and "finish=length" in done.stdout
    bad = subprocess.run([*cli, "--dtype", "int4", "hi"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'int4'" in bad.stderr


def _failing_for(marker_seed: int, real):  # noqa: ANN001, ANN202
    """`check_stop` that raises for requests sampled with ``marker_seed`` (fault injection)."""

    def check_stop(request, token_id, eos_ids):  # noqa: ANN001, ANN202
        if request.params.seed == marker_seed:
            raise RuntimeError("injected failure while applying the stop rules")
        return real(request, token_id, eos_ids)

    return check_stop


def test_one_requests_failure_in_a_step_spares_the_others(monkeypatch):
    llm = LLM(model="tiny")
    params = [SamplingParams(max_tokens=8, temperature=0.0, seed=s) for s in (1, 666, 2)]
    prompts = ["first prompt", "second prompt", "third prompt"]
    expected = llm.generate(prompts, params)
    failing = _failing_for(666, output_processor.check_stop)
    monkeypatch.setattr(output_processor, "check_stop", failing)
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[0].token_ids == expected[0].token_ids and outs[2].token_ids == expected[2].token_ids
    llm.engine.cache.check_integrity()
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks  # nothing held


def test_a_sampler_failure_fails_only_its_row(monkeypatch):
    llm = LLM(model="tiny")
    real = llm.engine.sampler.sample

    def sample(logits, params, generators, raw_logits=None):  # noqa: ANN001, ANN202
        if any(p.seed == 666 for p in params):
            raise RuntimeError("injected sampler failure")
        return real(logits, params, generators, raw_logits)

    monkeypatch.setattr(llm.engine.sampler, "sample", sample)
    params = [SamplingParams(max_tokens=4, temperature=0.0, seed=s, n=2) for s in (1, 666)]
    good, bad = llm.generate(["one", "two"], params)
    assert [o.finish_reason for o in good.outputs] == ["length", "length"]
    assert [o.finish_reason for o in bad.outputs] == ["error", "error"]


def test_server_answers_500_to_the_failing_request_and_serves_the_rest(monkeypatch):
    failing = _failing_for(666, output_processor.check_stop)
    monkeypatch.setattr(output_processor, "check_stop", failing)
    server = start_server(["--model", "tiny"])
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

        def complete(seed: int, stream: bool = False) -> str:
            kw = dict(model="tiny", prompt="a shared prompt " * 4, max_tokens=12, seed=seed)
            if stream:
                return "".join(c.choices[0].text for c in
                               client.completions.create(stream=True, temperature=0, **kw))
            return client.completions.create(temperature=0, **kw).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, s) for s in (1, 666, 2)]
            futures.append(pool.submit(complete, 3, True))
            results = []
            for future in futures:
                try:
                    results.append(future.result(timeout=60))
                except openai.InternalServerError as exc:
                    results.append(exc)
        assert isinstance(results[1], openai.InternalServerError)
        assert "RuntimeError" in str(results[1]) and "injected" not in str(results[1])
        assert all(isinstance(r, str) and r for r in results[::2] + results[3:])
        assert complete(4)  # the engine is still serving
    finally:
        server.stop()
