"""jaxkv: a JAX/Pallas port of vLLM's paged KV-cache engine.

    from jaxkv import LLM, SamplingParams
    llm = LLM("tiny-llama", kv_cache_memory_bytes=64 << 20)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))
    emb = llm.embed([[1, 2, 3]])    # pooled hidden states (jaxkv.pooling_params)

The repository's top-level ``models/`` and ``pallas_kernels/`` folders are the subpackages
``jaxkv.models`` and ``jaxkv.pallas_kernels``: an installed wheel maps them there
(pyproject.toml's ``package-dir``), so a user's own ``models`` package (research repositories
often have one) neither shadows them nor is shadowed by them.
"""

import os as _os

# A source checkout (an editable install, a worktree, ``PYTHONPATH=.``): the two folders sit
# next to this package's, so this package's search path also covers the checkout's root.
# (The checkout's ``tests`` package would resolve as ``jaxkv.tests`` too; nothing imports it so.)
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (
    not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "models"))
    and all(
        _os.path.isfile(_os.path.join(_root, d, "__init__.py"))
        for d in ("models", "pallas_kernels")
    )
    and _os.path.isfile(_os.path.join(_root, "pyproject.toml"))
):
    __path__.append(_root)
del _root

from jaxkv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxkv.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxkv.pooling_params import PoolerConfig, PoolingParams
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

# The engine imports jax; it loads on first use of these names, so that the host core
# (``import jaxkv.core``), which has no jax import, can be used without loading jax.
_LAZY = {
    "LLM": "jaxkv.entrypoints.llm",
    "LLMEngine": "jaxkv.engine",
    "EngineConfig": "jaxkv.engine_config",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
    "RequestOutputKind",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PoolingParams",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"
