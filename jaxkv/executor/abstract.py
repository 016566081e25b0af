"""The executor seam (vLLM V1's ``Executor``): how the engine core reaches its workers.

The engine core (``jaxkv.engine.core.EngineCore``) never touches a device. At start-up it asks
the executor for every worker's KV-cache specs and the memory each has for KV, builds one
``KVCacheConfig`` per worker rank (``jaxkv.kv_cache.get_kv_cache_configs``) and hands the
list back; each worker keeps ``configs[rank]``. Each step it passes the ``SchedulerOutput``
to ``execute_model`` and gets the driver worker's ``ModelRunnerOutput``.

Implementations: ``jaxkv.executor.uniproc.UniProcExecutor`` (the one worker in this process,
the default) and ``jaxkv.executor.multiproc.MultiprocExecutor`` (one worker process per JAX
process of a ``jax.distributed`` job). This module imports no jax.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from typing import Any

#: ``distributed_executor_backend`` values -> "module:class".
EXECUTOR_BACKENDS = {
    "uni": "jaxkv.executor.uniproc:UniProcExecutor",
    "mp": "jaxkv.executor.multiproc:MultiprocExecutor",
}


class Executor(abc.ABC):
    """Starts the workers (each runs ``Worker.init_device`` and ``Worker.load_model``) and
    forwards calls to them.

    Args:
      config: the engine's ``EngineConfig`` (picklable: it crosses process boundaries).
      model: an NNX model built in this process (only an in-process executor can use one).
    """

    def __init__(self, config, model=None):
        self.config = config
        self._init_executor(model)

    @staticmethod
    def get_class(config) -> type[Executor]:
        """The executor class for ``config.distributed_executor_backend``."""
        name = config.distributed_executor_backend
        if name not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {sorted(EXECUTOR_BACKENDS)}, "
                f"got {name!r}"
            )
        module, cls = EXECUTOR_BACKENDS[name].split(":")
        return getattr(importlib.import_module(module), cls)

    @abc.abstractmethod
    def _init_executor(self, model) -> None:
        """Starts the workers and loads the model on each."""

    @abc.abstractmethod
    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        """Calls ``method`` (a ``Worker`` method name, or a function taking the worker first)
        on every worker; one result per rank, in rank order."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output, non_block: bool = False):
        """Runs one step on every worker; the driver's ``ModelRunnerOutput``. With
        ``non_block`` it returns at once a future (``.result()``) of that output, or None when
        nothing was scheduled (async scheduling overlaps the next schedule with the step)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the workers (idempotent)."""

    # ---- start-up: what every executor does the same way through collective_rpc -------------

    def get_kv_cache_specs(self) -> list[dict]:
        """Each worker's ``{layer name: KVCacheSpec}``, by rank."""
        return self.collective_rpc("get_kv_cache_spec")

    def determine_available_memory(self) -> list[int]:
        """Bytes each worker has for its KV cache, by rank."""
        return self.collective_rpc("determine_available_memory")

    def initialize_from_config(self, kv_cache_configs: list) -> None:
        """Hands every worker the whole list; each keeps ``kv_cache_configs[rank]``
        (``WorkerWrapperBase.initialize_from_config``) and allocates its buffers."""
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))

    def compile_or_warm_up_model(self) -> int:
        """Warms every worker up; returns the programs the driver worker has compiled."""
        return int(self.collective_rpc("compile_or_warm_up_model")[0] or 0)

    def recover_after_failure(self, req_ids) -> bool:
        """Makes every worker consistent after a failed step, forgetting ``req_ids`` (None:
        every request); True when a worker's KV buffers were lost (every running request
        must be recomputed)."""
        ids = None if req_ids is None else list(req_ids)
        return any(self.collective_rpc("recover_after_failure", args=(ids,)))

    def get_runner_stats(self) -> dict:
        """The driver worker's compile and speculative-decoding counters."""
        return self.collective_rpc("runner_stats")[0]
