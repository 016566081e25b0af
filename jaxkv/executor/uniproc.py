"""UniProcExecutor (vLLM V1's): the one worker in the engine core's own process, called
directly (no serialisation, no thread): today's single-process speed."""

from __future__ import annotations

from collections.abc import Callable

from jaxkv.executor.abstract import Executor
from jaxkv.worker.worker_base import WorkerWrapperBase


class _PendingStep:
    """A dispatched step; ``result()`` waits for the device and returns its output."""

    __slots__ = ("_runner", "_handle")

    def __init__(self, runner, handle):
        self._runner, self._handle = runner, handle

    def result(self):
        return self._runner.collect(self._handle)


class UniProcExecutor(Executor):
    """One worker (rank 0), which may still span several local devices (tensor parallel)."""

    def _init_executor(self, model) -> None:
        self.driver_worker = WorkerWrapperBase(rpc_rank=0)
        self.driver_worker.init_worker(self.config, model=model)
        self.driver_worker.execute_method("init_device")
        self.driver_worker.execute_method("load_model")

    @property
    def model_runner(self):
        """The worker's runner (in-process only: tests and benchmarks inspect it)."""
        return self.driver_worker.worker.model_runner

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        return [self.driver_worker.execute_method(method, *args, **(kwargs or {}))]

    def execute_model(self, scheduler_output, non_block: bool = False):
        runner = self.driver_worker.worker.model_runner
        if not non_block:
            return runner.execute_model(scheduler_output)
        handle = runner.dispatch(scheduler_output)
        if handle is None and runner.kv_connector_hooks is None:
            return None  # nothing scheduled: nothing to update (a connector still reports)
        return _PendingStep(runner, handle)

    def shutdown(self) -> None:
        worker = self.driver_worker.worker
        if worker is not None:
            worker.shutdown()
