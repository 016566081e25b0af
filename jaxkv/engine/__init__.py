"""The engine (vLLM V1's seams): ``LLMEngine`` = input processor -> ``EngineCore``
(scheduler + executor) -> ``OutputProcessor``.

``jaxkv.engine.core`` and ``jaxkv.engine.output_processor`` import no jax (an engine-core
process needs none); ``LLMEngine`` does, so it loads on first use (PEP 562).
"""

_LAZY = {
    "EngineCore": "jaxkv.engine.core",
    "LLMEngine": "jaxkv.engine.llm_engine",
    "OutputProcessor": "jaxkv.engine.output_processor",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxkv.engine' has no attribute {name!r}")


__all__ = sorted(_LAZY)
