"""LoRA adapters through the official ``openai`` SDK against a real server (tiny model, adapters
written by peft): ``--lora-modules`` in both spellings, ``model: <name>`` picking one,
``/v1/models`` listing them under the base, answers equal transformers + peft's for adapters and
the base served together, ``cached_tokens`` never crossing adapters, the admins' load and unload
endpoints, and bad adapters refused with nothing disturbed (HTTP 4xx, or one line at start).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lora_helpers import ALL_TARGETS, peft_adapter, peft_greedy
from prefixcache.errors import CliError
from prefixcache.model import load_model
from prefixcache.server.cli import add_arguments, build_app
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tenants.toml"
ACME, OPS = "sk-acme-example-key-1", "sk-ops-admin-example-key"
PROMPT = "Adapters share one base model; each keeps its own blocks. " * 2  # 118 tokens
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root, base = tmp_path_factory.mktemp("adapters"), load_model("tiny").path
    configs = {"a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
               "b": dict(r=16, lora_alpha=16, target_modules=ALL_TARGETS),
               "big": dict(r=32, lora_alpha=32, target_modules=["o_proj"]),
               "d": dict(r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"])}  # fmt: skip
    return {name: (peft_adapter(base, root / name, seed=i + 11, **config), root / name)
            for i, (name, config) in enumerate(configs.items())}  # fmt: skip


@pytest.fixture(scope="module")
def expected(adapters: dict[str, tuple[Any, Path]]) -> dict[str, str]:
    """transformers + peft's greedy text for PROMPT, per model name."""
    tokenizer = load_model("tiny").tokenizer
    ids = tokenizer.encode(PROMPT)
    out = {"tiny": tokenizer.decode(peft_greedy(adapters["a"][0], ids, MAX_TOKENS, False))}
    for name in ("a", "b", "d"):
        out[name] = tokenizer.decode(peft_greedy(adapters[name][0], ids, MAX_TOKENS))
    return out


def _argv(adapters: dict[str, tuple[Any, Path]], secret: Path) -> list[str]:
    b = json.dumps({"name": "b", "path": str(adapters["b"][1]), "base_model_name": "tiny"})
    return ["--model", "tiny", "--tenants", str(EXAMPLE), "--secret-file", str(secret),
            "--block-size", "16", "--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "16", "--lora-modules", f"a={adapters['a'][1]}", b,
            "--allow-runtime-lora-updating"]


@pytest.fixture(scope="module")
def server(adapters: dict[str, tuple[Any, Path]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:  # fmt: skip
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_bytes(b"s" * 32)
    running = start_server(_argv(adapters, secret))
    yield running
    running.stop()


def client(server: RunningServer, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def complete(server: RunningServer, model: str, prompt: str = PROMPT) -> tuple[str, int]:
    out = client(server).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0.0, extra_body={"ignore_eos": True})
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def test_models_lists_each_adapter_under_the_base(
    server: RunningServer, adapters: dict[str, tuple[Any, Path]],
) -> None:
    models = {m.id: m for m in client(server).models.list()}
    assert set(models) == {"tiny", "a", "b"}
    for name in ("a", "b"):
        assert models[name].parent == "tiny" and models[name].root == str(adapters[name][1])
    assert client(server).models.retrieve("a").parent == "tiny"


def test_adapters_and_the_base_together_answer_as_peft_and_never_share_blocks(
    server: RunningServer, expected: dict[str, str],
) -> None:
    names = ["tiny", "a", "b"] * 2
    with ThreadPoolExecutor(len(names)) as pool:  # in flight together: mixed batches
        answers = list(pool.map(lambda m: complete(server, m, f"{m}: {PROMPT}"), names))
    assert [text for text, _ in answers[:3]] == [text for text, _ in answers[3:]]
    prompt = f"fresh {PROMPT}"
    first = {name: complete(server, name, prompt)[1] for name in ("a", "b", "tiny")}
    assert first == {"a": 0, "b": 0, "tiny": 0}  # one prompt, three namespaces
    for name in ("tiny", "a", "b"):
        text, cached = complete(server, name)
        assert text == expected[name]
        assert complete(server, name)[1] == 112 and cached in (0, 112)


def test_chat_picks_the_adapter_by_model(server: RunningServer) -> None:
    messages: list[Any] = [{"role": "user", "content": "Which adapter answers?"}]
    texts = {m: client(server).chat.completions.create(
        model=m, messages=messages, max_tokens=6, temperature=0.0).choices[0].message.content
        for m in ("tiny", "a", "b")}  # fmt: skip
    assert len(set(texts.values())) == 3


def test_an_unknown_model_is_a_404(server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(server, "c")


def _post(server: RunningServer, route: str, body: dict[str, Any], key: str = OPS
          ) -> httpx.Response:  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/{route}", json=body,
                      headers={"authorization": f"Bearer {key}"}, timeout=60)


def test_admins_load_and_unload_adapters_and_the_same_files_share_blocks(
    server: RunningServer, adapters: dict[str, tuple[Any, Path]],
) -> None:
    body = {"lora_name": "c", "lora_path": str(adapters["b"][1])}
    assert _post(server, "load_lora_adapter", body, key=ACME).status_code == 403
    loaded = _post(server, "load_lora_adapter", body)
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert _post(server, "load_lora_adapter", body).status_code == 400  # already loaded
    prompt = f"shared {PROMPT}"
    text_b, _ = complete(server, "b", prompt)
    text_c, cached = complete(server, "c", prompt)  # b's files under another name
    assert (text_c, cached) == (text_b, 112)
    assert "c" in {m.id for m in client(server).models.list()}
    assert _post(server, "unload_lora_adapter", {"lora_name": "c"}, key=ACME).status_code == 403
    assert _post(server, "unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert _post(server, "unload_lora_adapter", {"lora_name": "c"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        complete(server, "c")
    assert complete(server, "b", prompt) == (text_b, 112)  # b keeps its blocks


def _load(server: RunningServer, name: str, path: Path) -> httpx.Response:
    return _post(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def test_an_unload_lets_running_requests_finish_with_the_adapter_then_frees_its_blocks(
    server: RunningServer, adapters: dict[str, tuple[Any, Path]],
) -> None:
    assert _load(server, "d", adapters["d"][1]).status_code == 200
    tokenizer = load_model("tiny").tokenizer
    prompt = f"unloaded mid-stream: {PROMPT}"
    want = tokenizer.decode(peft_greedy(adapters["d"][0], tokenizer.encode(prompt), 64))
    chunks = iter(client(server).completions.create(
        model="d", prompt=prompt, max_tokens=64, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}))  # fmt: skip
    text = next(chunks).choices[0].text  # running under d now
    assert _post(server, "unload_lora_adapter", {"lora_name": "d"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as info:  # new requests: no such adapter
        complete(server, "d")
    assert info.value.body["code"] == "model_not_found"
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want  # the running request finished under d
    assert "d" not in {m.id for m in client(server).models.list()}
    # its blocks were freed once it ended: the same files loaded again find none of them
    assert _load(server, "d-again", adapters["d"][1]).status_code == 200
    assert complete(server, "d-again", prompt)[1] == 0
    assert complete(server, "d-again", prompt)[1] > 0  # (and cache their own)
    assert _post(server, "unload_lora_adapter", {"lora_name": "d-again"}).status_code == 200


def test_requests_racing_an_unload_get_the_adapters_answer_or_a_404_never_another(
    server: RunningServer, adapters: dict[str, tuple[Any, Path]], expected: dict[str, str],
) -> None:
    def ask(i: int) -> str | int:
        try:
            return complete(server, "d", PROMPT)[0]
        except openai.NotFoundError as exc:
            assert exc.body["code"] == "model_not_found"
            return 404

    for _ in range(3):
        assert _load(server, "d", adapters["d"][1]).status_code == 200
        with ThreadPoolExecutor(6) as pool:
            answers = pool.map(ask, range(18))
            gone = _post(server, "unload_lora_adapter", {"lora_name": "d"})
            answers = list(answers)  # fmt: skip
        assert gone.status_code == 200
        assert set(answers) <= {expected["d"], 404}, answers  # never the base's, never a 500
        assert "d" not in {m.id for m in client(server).models.list()}  # not loaded back
        assert ask(0) == 404
    assert complete(server, "a")[0] == expected["a"]


def test_loads_of_one_name_racing_each_other_or_an_unload_leave_one_adapter(
    server: RunningServer, adapters: dict[str, tuple[Any, Path]], expected: dict[str, str],
) -> None:
    with ThreadPoolExecutor(2) as pool:  # each passes the first check; one is installed
        statuses = sorted(pool.map(lambda _: _load(server, "e", adapters["d"][1]).status_code,
                                   range(2)))  # fmt: skip
    assert statuses == [200, 400]
    for _ in range(4):
        with ThreadPoolExecutor(2) as pool:
            unload = pool.submit(_post, server, "unload_lora_adapter", {"lora_name": "e"})
            load = pool.submit(_load, server, "e", adapters["d"][1])
            codes = (unload.result().status_code, load.result().status_code)
        assert codes in ((200, 200), (200, 400), (404, 200)), codes
        listed = "e" in {m.id for m in client(server).models.list()}
        if listed:  # whichever came last, the registry and the answers agree
            assert complete(server, "e")[0] == expected["d"]
        else:
            with pytest.raises(openai.NotFoundError):
                complete(server, "e")
        if not listed:
            assert _load(server, "e", adapters["d"][1]).status_code == 200
    assert _post(server, "unload_lora_adapter", {"lora_name": "e"}).status_code == 200


def _broken(adapters: dict[str, tuple[Any, Path]], out: Path, how: str) -> Path:
    if how == "rank":
        return adapters["big"][1]
    if how == "missing":
        return out / "nowhere"
    shutil.copytree(adapters["a"][1], out / how)
    weights, config = out / how / "adapter_model.safetensors", out / how / "adapter_config.json"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:  # a target the model lacks
        data = json.loads(config.read_text())
        config.write_text(json.dumps({**data, "target_modules": ["q_proj", "lm_head"]}))
    return out / how


@pytest.mark.parametrize("how, message", [
    ("missing", "does not exist"), ("rank", "exceeds the maximum LoRA rank 16"),
    ("truncated", "not a readable safetensors"), ("target", "lm_head"),
])  # fmt: skip
def test_a_bad_adapter_is_a_400_and_disturbs_nothing(
    server: RunningServer, adapters: dict[str, tuple[Any, Path]], expected: dict[str, str],
    tmp_path: Path, how: str, message: str,
) -> None:  # fmt: skip
    body = {"lora_name": "bad", "lora_path": str(_broken(adapters, tmp_path, how))}
    response = _post(server, "load_lora_adapter", body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert {m.id for m in client(server).models.list()} == {"tiny", "a", "b"}
    assert complete(server, "a")[0] == expected["a"]


def _build(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    build_app(parser.parse_args([*argv, "--dtype", "float32", "--no-dashboard"]))


def test_a_bad_module_at_start_is_one_line(adapters: dict[str, tuple[Any, Path]],
                                           tmp_path: Path) -> None:  # fmt: skip
    with pytest.raises(CliError, match="cannot load LoRA adapter 'x'.*does not exist"):
        _build(["--model", "tiny", "--enable-lora", "--lora-modules", f"x={tmp_path}/no"])
    with pytest.raises(CliError, match="rank 32 exceeds"):
        _build(["--model", "tiny", "--enable-lora", "--lora-modules",
                f"big={adapters['big'][1]}"])
    with pytest.raises(CliError, match="need --enable-lora"):
        _build(["--model", "tiny", "--lora-modules", f"a={adapters['a'][1]}"])
    with pytest.raises(CliError, match="expected name=path"):
        _build(["--model", "tiny", "--enable-lora", "--lora-modules", "just-a-name"])


def test_diagnostics_name_a_changed_adapter(server: RunningServer) -> None:
    """Why did it miss (issue 53): the same conversation under another adapter of the same base
    is ``adapter_changed`` (not the vendors' ``model_changed``), and under the same one a hit."""
    def respond(model: str, earlier: str | None) -> Any:
        options = {"comparison_response_id": earlier} if earlier else {}
        return client(server).responses.create(
            model=model, instructions="Adapters keep their own blocks. " * 4, input="Which?",
            max_output_tokens=2, temperature=0.0, extra_body={"prompt_cache_options": options})

    first = respond("a", None)
    moved = respond("b", first.id).prompt_cache_diagnostics
    assert moved.type == "cache_miss" and moved.reason == "adapter_changed"
    assert moved.cache_missed_tokens > 0
    assert respond("a", first.id).prompt_cache_diagnostics.type == "cache_hit"
    assert respond("tiny", first.id).prompt_cache_diagnostics.reason == "adapter_changed"


def test_smollm2_serves_two_adapters_and_the_base_together_as_peft_without_shared_blocks(
    tmp_path: Path,
) -> None:
    """The issue's check: ``serve --model smollm2 --enable-lora --lora-modules a=DIR b=DIR``
    answers a, b and the base, in flight together, as transformers + peft do (float32), and
    ``cached_tokens`` shows no reuse across them."""
    base = load_model("smollm2")
    targets = {"a": (["q_proj", "v_proj", "o_proj", "down_proj"], 0.05), "b": (ALL_TARGETS, 0.1)}
    models = {name: peft_adapter(base.path, tmp_path / name, seed=i + 5, scale=scale, r=16,
                                 lora_alpha=16, target_modules=t)
              for i, (name, (t, scale)) in enumerate(targets.items())}  # fmt: skip
    prompt = "Many fine-tunes of one base model share a server; each keeps its blocks. " * 2
    ids = base.tokenizer.encode(prompt)
    want = {name: base.tokenizer.decode(peft_greedy(m, ids, MAX_TOKENS))
            for name, m in models.items()}  # fmt: skip
    want["smollm2"] = base.tokenizer.decode(peft_greedy(models["a"], ids, MAX_TOKENS, False))
    assert len(set(want.values())) == 3  # the adapters change the answer
    running = start_server(["--model", "smollm2", "--dtype", "float32", "--enable-lora",
                            "--max-loras", "2", "--lora-modules", f"a={tmp_path / 'a'}",
                            f"b={tmp_path / 'b'}"])  # fmt: skip
    try:
        names = ["smollm2", "a", "b"]
        with ThreadPoolExecutor(3) as pool:  # in flight together: steps mixing them
            answers = list(pool.map(lambda m: complete(running, m, prompt), names))
        first = dict(zip(names, answers, strict=True))
        assert {m: text for m, (text, _) in first.items()} == want
        assert {m: cached for m, (_, cached) in first.items()} == {m: 0 for m in names}
        for name in names:  # each hits its own blocks only
            assert complete(running, name, prompt) == (want[name], len(ids) // 16 * 16)
    finally:
        running.stop()
