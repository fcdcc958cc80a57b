"""The client libraries people point at an OpenAI-compatible server, unchanged, against a real
server: langchain-openai (chat invoke/stream/batch, the completions LLM batching several prompts
into one request), litellm (completion, text_completion, streaming) and lm-eval's
``local-completions`` model (a multiple-choice loglikelihood task and a generate_until task from
local JSONL files: the same accuracies and answers with the cache on and off)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_harness import RunningServer, start_server, tie_free_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
ARGS = ["--model", MODEL, "--num-kv-blocks", "512", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def server() -> RunningServer:
    running = start_server(ARGS)
    yield running
    running.stop()


def fresh(length: int = 60) -> str:
    return (f"[{uuid.uuid4().hex}] " + "a prefix cache keeps the keys and values. " * 10)[:length]


# ---- langchain-openai -----------------------------------------------------------------------


def test_langchain_chat_invoke_stream_batch(server) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=MODEL,
                      temperature=0.0, max_tokens=5, max_retries=0)
    question = tie_free_prompt("langchain-chat", 5, chat=True)
    reply = chat.invoke(question)
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] >= 1
    streamed = "".join(chunk.content for chunk in chat.stream(question))
    assert streamed == reply.content
    answers = chat.batch([question, fresh()])
    assert answers[0].content == reply.content and len(answers) == 2


def test_langchain_completions_llm_batches_prompts(server) -> None:
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=server.base_url + "/v1", api_key="unused", model=MODEL,
                 temperature=0.0, max_tokens=4, max_retries=0, batch_size=8)
    prompts = [tie_free_prompt(f"langchain-llm-{i}", 4) for i in range(3)]
    alone = [llm.invoke(p) for p in prompts]
    result = llm.generate(prompts)  # one request with a list of three prompts
    assert [g[0].text for g in result.generations] == alone
    assert llm.batch(prompts) == alone


# ---- litellm --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm():
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the price list
    import litellm

    litellm.telemetry = False
    return litellm


def test_litellm_completion_text_completion_and_stream(server, litellm) -> None:
    base = server.base_url + "/v1"
    messages = [{"role": "user", "content": tie_free_prompt("litellm-chat", 5, chat=True)}]
    out = litellm.completion(model=f"openai/{MODEL}", api_base=base, api_key="unused",
                             messages=messages, max_tokens=5, temperature=0.0)
    text = out.choices[0].message.content
    assert out.usage.completion_tokens >= 1
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(
        model=f"openai/{MODEL}", api_base=base, api_key="unused", messages=messages,
        max_tokens=5, temperature=0.0, stream=True))
    assert streamed == text
    prompt = tie_free_prompt("litellm-text", 4)
    expected = httpx.post(base + "/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True, "cache_salt": "sdk"}).json()
    completion = litellm.text_completion(model=f"text-completion-openai/{MODEL}", api_base=base,
                                         api_key="unused", prompt=prompt, max_tokens=4,
                                         temperature=0.0, ignore_eos=True)
    assert completion.choices[0].text == expected["choices"][0]["text"]
    assert completion.usage.prompt_tokens == expected["usage"]["prompt_tokens"]


# ---- lm-eval --------------------------------------------------------------------------------

ANIMALS = ["cat", "dog", "cow", "hen", "fox", "owl", "bee", "ant", "elk", "yak"]


def _write_tasks(root: Path) -> None:
    mc = root / "mc.jsonl"
    gen = root / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": f"Which word names the animal {a}?",
                                      "choices": ["rock", a, "tree", "lamp"], "answer": 1}) + "\n"
                          for a in ANIMALS))
    gen.write_text("".join(json.dumps({"question": f"Repeat the word {a}:", "answer": a}) + "\n"
                           for a in ANIMALS))
    common = "dataset_path: json\ntest_split: test\nmetric_list:\n  - metric: {metric}\n"
    (root / "pc_mc.yaml").write_text(
        "task: pc_mc\n" + common.format(metric="acc")
        + f"dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        + "output_type: multiple_choice\ndoc_to_text: \"{{question}}\\nAnswer:\"\n"
        + "doc_to_choice: choices\ndoc_to_target: answer\n")
    (root / "pc_gen.yaml").write_text(
        "task: pc_gen\n" + common.format(metric="exact_match")
        + f"dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        + "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: answer\n"
        + "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n")


def _evaluate(server: RunningServer, root: Path) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = (f"model={MODEL},base_url={server.base_url}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=1,max_retries=1,batch_size=4")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args,
                                  tasks=["pc_mc", "pc_gen"],
                                  task_manager=TaskManager(include_path=str(root)),
                                  log_samples=True)
    assert out is not None
    return out


def test_lm_eval_local_completions_same_with_cache_on_and_off(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _write_tasks(tmp_path)
    off = start_server([*ARGS, "--prefix-cache", "off"])
    try:
        runs = [_evaluate(server, tmp_path), _evaluate(server, tmp_path),  # cold, then warm
                _evaluate(off, tmp_path)]
    finally:
        off.stop()
    for task, metric in (("pc_mc", "acc,none"), ("pc_gen", "exact_match,none")):
        values = [run["results"][task][metric] for run in runs]
        assert values[0] == values[1] == values[2], (task, values)
    for task in ("pc_mc", "pc_gen"):
        answers = [[s["filtered_resps"] for s in run["samples"][task]] for run in runs]
        assert answers[0] == answers[1] == answers[2]
    scores = [[s["resps"] for s in run["samples"]["pc_mc"]] for run in runs]
    assert len(scores[0]) == len(ANIMALS) and all(len(r) == 4 for r in scores[0])
    assert server.engine.stats()["hit_tokens"] > 0  # the warm run's generations hit
