"""prefixcache: a prefix-caching LLM inference engine.

The cache layer (`prefixcache.cache`) and the simulator (`prefixcache.sim`) import no torch.
`LLM`, `SamplingParams` and `LoRARequest` are imported lazily so that `import prefixcache`
stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "LoRARequest", "SamplingParams"):
        from prefixcache import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
