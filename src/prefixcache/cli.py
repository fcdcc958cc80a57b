"""The `prefixcache` command: one entry point, one sub-command per tool.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; heavy imports (torch, fastapi) happen inside ``run`` so that ``--help`` and
the torch-free tools stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from prefixcache.errors import CliError

__all__ = ["COMMANDS", "CliError", "build_parser", "main"]

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("prefixcache.cluster.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("prefixcache.engine.cli", "generate completions offline"),
    "lab": ("prefixcache.tools.lab", "the specification's hash-chain lab, on the real code"),
    "simulate": ("prefixcache.sim.cli", "replay traces through the real caches"),
    "bench": ("prefixcache.tools.bench", "the same shared-prefix batch with the cache off and on"),
    "explain": ("prefixcache.tools.explain", "why two prompts do (not) share a prefix"),
    "check": ("prefixcache.tools.check", "compare outputs with the cache on and off"),
    "stress": ("prefixcache.tools.stress", "stress the allocator on a tiny pool"),
    "audit": ("prefixcache.tools.audit", "timing audit of cache isolation against a server"),
    "cache": ("prefixcache.tiers.cli", "the lower KV tiers: purge a tenant's blocks"),
    "top": ("prefixcache.tools.top", "a live terminal view of a server's cache (like htop)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        sys.exit(2)
    try:
        code = args._run(args)
    except CliError as exc:
        print(f"prefixcache {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code or 0)

