"""`prefixcache explain`: the right first miss for token, salt, adapter, model and whitespace
changes, input forms, and secrets never printed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixcache.cache import Namespace
from prefixcache.cli import main
from prefixcache.tools.explain import ModelView, Prompt, explain, load_model_view, read_prompt

BASE = (
    "You are a careful assistant. Answer the question using the document below and cite the "
    "paragraph. Document: the quick brown fox jumps over the lazy dog while the cat sleeps."
)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["explain", *argv])
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_one_token_change_names_its_block_and_position(capsys: pytest.CaptureFixture[str]) -> None:
    changed = BASE[:70] + "X" + BASE[71:]  # byte tokenizer: text offset 70 -> token 71 (bos)
    out = run_json(capsys, BASE, changed)
    assert out["reason"] == "tokens"
    assert out["divergence_position"] == 71
    assert out["common_prefix_tokens"] == 71
    assert out["first_miss_block"] == 4 and out["first_miss_span"] == [64, 80]
    assert out["reusable_blocks"] == 4 and out["reusable_tokens"] == 64
    assert out["namespace_diff"] == [] and out["warnings"] == []


def test_salt_change_misses_block_zero_without_printing_the_salt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = "tenant-secret-7f3a"
    code, out, _ = run_cli(capsys, BASE, BASE, "--salt-a", secret, "--salt-b", "other-salt-q9")
    assert code == 0
    assert "first miss: block 0, tokens [0, 16)" in out
    assert "the namespace differs: cache salt" in out
    assert secret not in out and "other-salt-q9" not in out
    assert "common token prefix: " in out and "reusable: 0 blocks" in out


def test_same_salt_reuses_everything_complete(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, BASE, BASE, "--salt-a", "s", "--salt-b", "s")
    n = out["num_tokens_b"]
    assert out["first_miss_block"] is None and out["reason"] == "none"
    assert out["reusable_tokens"] == n // 16 * 16
    assert out["usable_tokens"] == (n - 1) // 16 * 16


def test_adapter_change_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, BASE, BASE, "--adapter-a", "lora-x", "--adapter-b", "lora-y")
    assert out["reason"] == "namespace" and out["namespace_diff"] == ["adapter"]
    assert out["first_miss_block"] == 0 and out["reusable_blocks"] == 0


def test_model_change_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = load_model_view("tiny")
    other = tmp_path / "tiny-rope"
    from prefixcache.model.loader import resolve_model_path

    shutil.copytree(resolve_model_path("tiny"), other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = 500000.0  # same tokenizer and weights, different KV
    (other / "config.json").write_text(json.dumps(config))
    assert load_model_view(str(other)).identity != tiny.identity
    code, out, _ = run_cli(capsys, BASE, BASE, "--model-b", str(other))
    assert code == 0
    assert "the namespace differs: model identity" in out
    assert "first miss: block 0" in out
    assert tiny.identity not in out  # named, never printed


def test_whitespace_difference_warns_and_points_at_it(capsys: pytest.CaptureFixture[str]) -> None:
    spaced = BASE.replace("Answer the", "Answer  the")
    out = run_json(capsys, BASE, spaced)
    assert "the texts differ only in whitespace" in out["warnings"]
    pos = BASE.index("Answer the") + len("Answer") + 1 + 1  # after "Answer ", +1 for bos
    assert out["divergence_position"] == pos
    assert out["first_miss_block"] == pos // 16


def test_unicode_normalization_warns(capsys: pytest.CaptureFixture[str]) -> None:
    nfc, nfd = "caf\u00e9 " * 8, "cafe\u0301 " * 8
    out = run_json(capsys, nfc, nfd)
    assert any("Unicode normalization" in w for w in out["warnings"])
    assert out["divergence_position"] == 4  # bos + "caf"


def test_show_tokens_prints_ids_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    a, b = "hello world " * 4, "hello there " * 4
    _, plain, _ = run_cli(capsys, a, b)
    assert ">>" not in plain and "119" not in plain
    _, shown, _ = run_cli(capsys, a, b, "--show-tokens")
    assert ">>119='w'<<" in shown and ">>116='t'<<" in shown


def test_texts_equal_tokens_differ_warns() -> None:
    a = Prompt([256, 104, 105], "hi")
    b = Prompt([256, 104, 105, 257], "hi")
    ns = Namespace("m")
    ex = explain(a, b, ns, ns, block_size=1)
    assert "the texts are equal but their tokens differ" in ex.warnings
    assert ex.reason == "a_shorter" and ex.first_miss_block == 3


def test_token_lists_files_and_chat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = list(range(40))
    (tmp_path / "a.json").write_text(json.dumps(ids))
    out = run_json(capsys, f"@{tmp_path / 'a.json'}", json.dumps(ids[:20] + [99] + ids[21:]))
    assert out["divergence_position"] == 20 and out["first_miss_block"] == 1
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " * 10}]
    other = [msgs[0], {"role": "user", "content": "ho " * 10}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(msgs))
    out = run_json(capsys, str(path), json.dumps(other), "--chat")
    tok = load_model_view("tiny").tokenizer
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
    prefix = rendered[: rendered.index("hi ")]
    # "hi" vs "ho": the byte after the shared "h"
    assert out["divergence_position"] == len(tok.encode(prefix, add_special_tokens=False)) + 1
    assert out["warnings"] == []


def test_bad_input_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "@/nonexistent/prompt.txt", "x")
    assert code == 2 and "cannot read" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "x", "y", "--block-size", "0")
    assert code == 2 and "--block-size" in err
    code, _, err = run_cli(capsys, '{"a": 1}', "[]", "--chat")
    assert code == 2 and "--chat expects" in err
    code, _, err = run_cli(capsys, "x", "y", "--model", "no-such-model")
    assert code == 2 and "cannot load model" in err


def test_read_prompt_keeps_text_for_warnings() -> None:
    tok = load_model_view("tiny").tokenizer
    prompt = read_prompt("abc", tok)
    assert prompt.kind == "text" and prompt.text == "abc" and prompt.token_ids == tok.encode("abc")


def test_explain_predicts_what_the_engine_hits() -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small to split
    try:
        _engine_hits_match(load_model_view("tiny"))
    finally:
        torch.set_num_threads(threads)


def _engine_hits_match(view: ModelView) -> None:
    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.sampling_params import SamplingParams

    engine = LLMEngine("tiny", num_kv_blocks=64)
    a = read_prompt(BASE, view.tokenizer)
    cases = [(BASE[:70] + "X" + BASE[71:], None), (BASE + " more", None), (BASE, "other-salt")]
    engine.add_request("a", BASE, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    for i, (text, salt) in enumerate(cases):
        b = read_prompt(text, view.tokenizer)
        ex = explain(a, b, Namespace(view.identity), Namespace(view.identity, salt=salt))
        engine.add_request(
            f"b{i}", text, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=salt
        )
        while engine.has_unfinished():
            outputs = engine.step()
        assert outputs[-1].num_cached_tokens == ex.usable_tokens, text


def test_public_prefix_splits_the_reusable_part(capsys: pytest.CaptureFixture[str]) -> None:
    """Two tenants (different salts) share a declared prefix's whole blocks and nothing after;
    a tenant the declaration does not list shares nothing."""
    declared = BASE[:100]  # BOS + 100 bytes: 6 whole blocks
    salts = ("--salt-a", "tenant-a-salt", "--salt-b", "tenant-b-salt")
    out = run_json(capsys, BASE, BASE, *salts, "--public-prefix", declared)
    assert out["public_blocks_b"] == 6 and out["reusable_public_blocks"] == 6
    assert out["reusable_blocks"] == 6 and out["first_miss_block"] == 6
    assert out["reason"] == "namespace" and out["namespace_diff"] == ["cache salt"]
    code, text, _ = run_cli(capsys, BASE, BASE, *salts, "--public-prefix", declared)
    assert code == 0 and "of the reusable blocks 6 are public and 0 B's own" in text
    alone = run_json(capsys, BASE, BASE, *salts, "--public-prefix", declared, "--public-for", "a")
    assert alone["reusable_blocks"] == 0 and alone["public_blocks_b"] == 0


def test_explain_predicts_the_engines_public_hits() -> None:
    import torch

    from prefixcache.cache import PublicPrefixes
    from prefixcache.engine.llm_engine import LLMEngine
    from prefixcache.engine.sampling_params import SamplingParams

    view = load_model_view("tiny")
    declared = read_prompt(BASE[:100], view.tokenizer).token_ids
    prefixes = PublicPrefixes({"p": declared})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine("tiny", num_kv_blocks=64)
        a = read_prompt(BASE, view.tokenizer)
        for rid, prompt, salt in (
            ("a", a, "salt-a"),
            ("b", read_prompt(BASE + " more", view.tokenizer), "salt-b"),
        ):
            num_public = prefixes.num_public_blocks(prompt.token_ids, ["p"], 16)
            engine.add_request(
                rid,
                prompt_token_ids=prompt.token_ids,
                cache_salt=salt,
                sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                public_blocks=num_public,
            )
            while engine.has_unfinished():
                outputs = engine.step()
        b = read_prompt(BASE + " more", view.tokenizer)
        ex = explain(
            a,
            b,
            Namespace(view.identity, salt="salt-a"),
            Namespace(view.identity, salt="salt-b"),
            public=(6, 6),
        )
        assert outputs[-1].num_cached_tokens == ex.usable_tokens == 96
    finally:
        torch.set_num_threads(threads)
