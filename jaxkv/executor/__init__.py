"""Executors: how the engine core reaches its workers (vLLM V1's seam).

``Executor.get_class(config)`` picks ``UniProcExecutor`` (in process, the default) or
``MultiprocExecutor`` (``distributed_executor_backend="mp"``). Importing this package loads no jax.
"""

from jaxkv.executor.abstract import EXECUTOR_BACKENDS, Executor

__all__ = ["EXECUTOR_BACKENDS", "Executor"]
