"""`prefixcache generate`: offline completions from arguments or a JSONL file.

Each JSONL line is either a JSON string or an object with ``prompt`` (text) or
``prompt_token_ids``, and optionally ``max_tokens``, ``temperature``, ``seed``, ``cache_salt``.
Prints one block per prompt: its cached prompt tokens, finish reason and completion.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefixcache.engine.config import EngineConfig, add_engine_arguments
from prefixcache.errors import CliError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (text); or use --file")
    parser.add_argument("--file", type=Path, help="JSONL file of prompts")
    add_engine_arguments(parser)
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user message, rendered with the chat template")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--cache-salt", default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object per completion")


def run(args: argparse.Namespace) -> int:
    items = _read_prompts(args)
    from prefixcache.engine.llm import LLM
    from prefixcache.engine.sampling_params import SamplingParams

    try:
        llm = LLM(config=EngineConfig.from_args(args))
        for item in items:
            params = SamplingParams(
                max_tokens=int(item.get("max_tokens", args.max_tokens)),
                temperature=float(item.get("temperature", args.temperature)),
                seed=item.get("seed", args.seed),
            )
            prompt = item["prompt"] if "prompt" in item else item["prompt_token_ids"]
            if args.chat and isinstance(prompt, str):
                prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
            salt = item.get("cache_salt", args.cache_salt)
            (out,) = llm.generate([prompt], params, cache_salt=salt)
            _print(out, args.json)
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc)) from None
    return 0


def _read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"prompt": p} for p in args.prompts]
    if args.file is not None:
        items.extend(_read_jsonl(args.file))
    if not items:
        raise CliError("no prompts: give them as arguments or with --file")
    return items


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
        items.append(_as_item(value, f"{path}:{number}"))
    return items


def _as_item(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, dict) and ("prompt" in value or "prompt_token_ids" in value):
        return value
    raise CliError(f"{where}: expected a string or an object with 'prompt' or 'prompt_token_ids'")


def _print(out: Any, as_json: bool) -> None:
    if as_json:
        record = {
            "request_id": out.request_id,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "finish_reason": out.finish_reason,
            "text": out.text,
            "token_ids": out.token_ids,
        }
        print(json.dumps(record, ensure_ascii=False))
        return
    print(
        f"[{out.request_id}] prompt_tokens={len(out.prompt_token_ids)} "
        f"cached_tokens={out.num_cached_tokens} finish={out.finish_reason}"
    )
    print(out.text)
