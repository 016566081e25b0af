"""WorkerWrapperBase (vLLM V1's): what an executor holds per worker rank.

It knows its rank before the worker exists, so it is where a worker picks its own
``KVCacheConfig`` from the engine core's per-rank list, and where remote calls
(``collective_rpc``) are dispatched to worker methods by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class WorkerWrapperBase:
    """One worker rank: ``init_worker`` builds the ``Worker``; ``execute_method`` runs a
    method by name (or a function taking the worker first) on it.

    Args:
      rpc_rank: the rank collective_rpc results are ordered by.
      global_rank: the worker's rank in the whole job (``jax.process_index()`` when each
        worker is a JAX process); it indexes the per-rank config list.
    """

    def __init__(self, rpc_rank: int = 0, global_rank: int | None = None):
        self.rpc_rank = rpc_rank
        self.global_rank = rpc_rank if global_rank is None else global_rank
        self.worker = None

    def init_worker(self, config, *, local_rank: int = 0, model=None) -> None:
        from jaxkv.worker.worker import (
            Worker,
        )  # the worker's process imports jax; the core's need not

        self.worker = Worker(config, rank=self.global_rank, local_rank=local_rank, model=model)

    def initialize_from_config(self, kv_cache_configs: list) -> None:
        """Keeps ``kv_cache_configs[global_rank]``: each worker allocates its own plan."""
        if not 0 <= self.global_rank < len(kv_cache_configs):
            raise ValueError(
                f"worker rank {self.global_rank} has no KV-cache config: the engine core "
                f"built {len(kv_cache_configs)}"
            )
        self.worker.initialize_from_config(kv_cache_configs[self.global_rank])

    def execute_method(self, method: str | Callable, *args, **kwargs) -> Any:
        if callable(method):
            return method(self.worker, *args, **kwargs)
        if method == "initialize_from_config":  # the wrapper's own: it picks the rank's config
            return self.initialize_from_config(*args, **kwargs)
        target = getattr(self.worker, method, None)
        if target is None or method.startswith("_"):
            raise AttributeError(f"the worker has no method {method!r}")
        return target(*args, **kwargs)
