"""Coverage-guided fuzzing of one file reader with atheris (libFuzzer), for runs longer than the
suite's: the same targets as tests/test_fuzz_readers.py (`fuzz_targets`), started from their
valid seeds and the kept crashers.

    .venv/bin/pip install atheris
    .venv/bin/python tests/fuzz_atheris.py TARGET [WORK_DIR] [libFuzzer flags ...]
    .venv/bin/python tests/fuzz_atheris.py tenants /tmp/fuzz-tenants -max_total_time=600

TARGET is one of `fuzz_targets.targets()` (gguf, safetensors, tokenizer, chat_template, tenants,
secret, mooncake, record, agentic). WORK_DIR (default ``fuzz-work/TARGET``) holds the growing
corpus; libFuzzer writes an input that crashed as ``crash-<sha1>`` in the current directory.
Copy it to ``tests/fuzz_corpus/TARGET/<what-it-does>`` and the suite replays it from then on.
A crash is any exception other than the reader's own refusal naming the file, or a refusal that
does not name it; ``-timeout=N`` turns a hang into one and ``-rss_limit_mb=N`` unbounded memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).parent))

with atheris.instrument_imports(include=["prefixcache"]):
    import prefixcache.model.chat_template  # noqa: F401 - instrumented for coverage
    import prefixcache.model.gguf_checkpoint  # noqa: F401
    import prefixcache.model.loader  # noqa: F401
    import prefixcache.model.tokenizer  # noqa: F401
    import prefixcache.model.weights  # noqa: F401
    import prefixcache.server.tenancy  # noqa: F401
    import prefixcache.sim.loader  # noqa: F401

from fuzz_targets import corpus, targets  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in targets():
        sys.exit(f"usage: {sys.argv[0]} TARGET [WORK_DIR] [libFuzzer flags]; TARGET one of "
                 f"{', '.join(targets())}")
    target = targets()[sys.argv[1]]
    rest = sys.argv[2:]
    work = Path(rest.pop(0)) if rest and not rest[0].startswith("-") else Path(
        "fuzz-work", target.name)
    work.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(target.seeds()):
        (work / f"seed-{i}").write_bytes(seed)
    for path in corpus(target.name):
        (work / f"kept-{path.name}").write_bytes(path.read_bytes())
    atheris.Setup([sys.argv[0], str(work), *rest], target.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
