"""jaxkv: a JAX/Pallas port of vLLM's paged KV-cache engine.

    from jaxkv import LLM, SamplingParams
    llm = LLM("tiny-llama", kv_cache_memory_bytes=64 << 20)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))
"""

from jaxkv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxkv.engine import LLM, LLMEngine
from jaxkv.engine_config import EngineConfig
from jaxkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
    "RequestMetrics", "Logprob", "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = "0.1.0"
