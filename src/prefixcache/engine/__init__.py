"""The engine: requests, sampling, the model runner, `LLMEngine` (add_request / step / abort),
the offline `LLM` and `EngineConfig`. The scheduler it drives lives in `prefixcache.sched`.

Names load on first use, so ``prefixcache.engine.config`` (flags and settings) imports no torch;
everything else here does. `prefixcache.cache` and `prefixcache.sched` stay torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "GenerationOutput",
    "LLMEngine",
    "LoRARequest",
    "Request",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
]

_WHERE = {
    "LLM": "prefixcache.engine.llm",
    "LLMEngine": "prefixcache.engine.llm_engine",
    "EngineConfig": "prefixcache.engine.config",
    "LoRARequest": "prefixcache.engine.lora",
    "CompletionOutput": "prefixcache.engine.outputs",
    "GenerationOutput": "prefixcache.engine.outputs",
    "RequestOutput": "prefixcache.engine.outputs",
    "Request": "prefixcache.engine.request",
    "Sampler": "prefixcache.engine.sampler",
    "SamplingParams": "prefixcache.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'prefixcache.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
