"""The engine: requests, sampling, the continuous-batching scheduler, the model runner,
`LLMEngine` (add_request / step / abort) and the offline `LLM`.

Importing this package imports torch; `prefixcache.cache` stays torch-free.
"""

from prefixcache.engine.llm import LLM
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.outputs import CompletionOutput, GenerationOutput, RequestOutput
from prefixcache.engine.request import Request, RequestStatus
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.sched import Scheduler, SchedulerOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "GenerationOutput",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
]
