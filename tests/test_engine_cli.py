"""`prefixcache generate` on the tiny model: prompts from arguments and JSONL, clear errors."""

from __future__ import annotations

import json

import pytest

from prefixcache.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(["generate", *argv])
    return int(exc.value.code or 0)


def test_generate_reports_cached_tokens(tmp_path, capsys):
    prompt = "A system prompt long enough to fill several blocks of four tokens."
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": prompt, "max_tokens": 3}) + "\n" + json.dumps(prompt))
    argv = [prompt, "--file", str(jsonl), "--block-size", "4", "--num-kv-blocks", "64", "--json"]
    assert _run([*argv, "--max-tokens", "5"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(r["token_ids"]) for r in records] == [5, 3, 5]
    assert records[0]["num_cached_tokens"] == 0
    assert records[1]["num_cached_tokens"] == (records[1]["num_prompt_tokens"] - 1) // 4 * 4
    assert records[2]["token_ids"] == records[0]["token_ids"]

    assert _run([*argv, "--prefix-cache", "off"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(r["num_cached_tokens"] == 0 for r in records)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no prompts"),
        (["hi", "--max-tokens", "0"], "max_tokens"),
        (["x" * 300, "--block-size", "4", "--num-kv-blocks", "8"], "pool has only 8"),
    ],
)
def test_generate_user_errors_are_one_line(argv, message, capsys):
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_generate_bad_jsonl(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    assert _run(["--file", str(bad)]) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
