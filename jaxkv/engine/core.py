"""EngineCore (vLLM V1's): the scheduler, the executor and the step loop. No jax import.

At start-up it builds the per-rank KV-cache plans from what the workers report (vLLM's
``_initialize_kv_caches``):

    specs = executor.get_kv_cache_specs()            # one {layer: KVCacheSpec} per rank
    memory = executor.determine_available_memory()   # bytes for KV per rank
    configs = get_kv_cache_configs(specs, memory)    # one KVCacheConfig per rank, min num_blocks
    executor.initialize_from_config(configs)         # each worker keeps configs[rank]

Each ``step`` schedules, runs the step on the workers and updates the scheduler from the
driver's output. With async scheduling the loop is one step deep (vLLM's batch queue).

With a ``kv_transfer_config`` the core builds the scheduler side of the KV connector and hands
it every worker's handshake metadata (e.g. transfer addresses) collected at start-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from jaxkv.core import EngineCoreOutput, Request, RequestStatus, Scheduler
from jaxkv.core.async_scheduler import AsyncScheduler
from jaxkv.core.recovery import abort_failed_steps, drop_all_kv, remove_requests, reset_scheduler
from jaxkv.core.sched_output import SchedulerOutput
from jaxkv.kv_cache import KVCacheConfig, get_kv_cache_configs


class EngineCore:
    """Scheduler + executor.

    Args:
      config: the engine's ``EngineConfig``.
      executor_class: an ``Executor`` subclass (``Executor.get_class(config)``).
      model: an NNX model built in this process (in-process executors only).
    """

    def __init__(self, config, executor_class, model=None):
        self.config = config
        self.model_executor = executor_class(config, model)
        try:
            self.kv_cache_configs = self._initialize_kv_caches()
            self.kv_cache_config: KVCacheConfig = self.kv_cache_configs[0]
            scheduler_class = (
                AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
            )
            self.scheduler = scheduler_class(
                self.kv_cache_config,
                config.scheduler_config,
                kv_connector=self._make_kv_connector(),
            )
            #: Programs the driver worker has compiled (warm-up included), then from its outputs.
            self.num_compiles = self.model_executor.compile_or_warm_up_model()
        except BaseException:
            self.model_executor.shutdown()
            raise
        self._in_flight: tuple[SchedulerOutput, object] | None = (
            None  # async: dispatched, not collected
        )
        self.last_schedule_time = 0.0  # perf_counter() when the last step was scheduled

    def _make_kv_connector(self):
        kt = getattr(self.config, "kv_transfer_config", None)
        if kt is None:
            return None
        from jaxkv.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole

        connector = KVConnectorFactory.create_connector(
            kt,
            KVConnectorRole.SCHEDULER,
            self.kv_cache_config,
            world_size=len(self.kv_cache_configs),
        )
        connector.set_xfer_handshake_metadata(
            dict(enumerate(self.model_executor.collective_rpc("get_kv_connector_handshake")))
        )
        return connector

    def _initialize_kv_caches(self) -> list[KVCacheConfig]:
        c = self.config
        specs = self.model_executor.get_kv_cache_specs()
        memory = self.model_executor.determine_available_memory()
        configs = get_kv_cache_configs(
            specs,
            memory,
            max_model_len=c.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens,
            num_gpu_blocks_override=c.num_gpu_blocks_override,
        )
        self.model_executor.initialize_from_config(configs)
        return configs

    # ---- requests -----------------------------------------------------------------------------

    def add_requests(self, requests: list[Request]) -> None:
        """Queues all of ``requests`` or none (a refused one, or an interrupt, removes the rest)."""
        try:
            for req in requests:
                self.scheduler.add_request(req)
        except BaseException:
            remove_requests(
                self.scheduler, {r.request_id for r in requests} & set(self.scheduler.requests)
            )
            raise

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, status)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def in_flight_request_ids(self) -> set[str]:
        """Requests of the step in flight (async scheduling), whose results are not in yet."""
        return (
            set(self._in_flight[0].num_scheduled_tokens) if self._in_flight is not None else set()
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose KV is still being sent (their blocks are kept): the loop
        must keep stepping (empty steps) for the workers to report the sends done."""
        return self.scheduler.has_pending_kv_sends()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ---- steps --------------------------------------------------------------------------------

    def step(self) -> tuple[list[EngineCoreOutput], SchedulerOutput]:
        """One schedule -> execute -> update; the core outputs and the step's schedule.

        With async scheduling this dispatches step N+1 and returns step N's outputs."""
        if not self.config.scheduler_config.async_scheduling:
            so = self._schedule()
            outputs = self._update(so, self.model_executor.execute_model(so))
            self._idle_wait(so)
            return outputs, so
        outputs = []
        so = self._schedule()
        pending = self.model_executor.execute_model(so, non_block=True)
        if self._in_flight is not None:
            outputs += self._finish_in_flight()
        elif pending is None and self.scheduler.has_unfinished_requests():
            stuck = {r.request_id: r.num_output_placeholders for r in self.scheduler.running}
            raise RuntimeError(
                f"async scheduling made no progress: nothing scheduled and no step in "
                f"flight; running requests (id: placeholders) {stuck}"
            )
        if pending is not None:  # None: nothing was scheduled, so there is nothing to update
            self._in_flight = (so, pending)
        self._idle_wait(so)
        return outputs, so

    def _idle_wait(self, so: SchedulerOutput) -> None:
        """A step that computed nothing while KV transfers are in flight waits a moment, so
        polling them does not spin two cores."""
        if so.total_num_scheduled_tokens == 0 and self.scheduler.connector is not None:
            time.sleep(0.002)

    def _schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        self.last_schedule_time = time.perf_counter()
        return so

    def finish_in_flight_if_idle(self) -> list[EngineCoreOutput]:
        """Collects the step in flight when every one of its requests has finished (its
        tokens are dropped), so the engine is idle once the last output is returned."""
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            return self._finish_in_flight()
        return []

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        so, pending = self._in_flight
        self._in_flight = None
        return self._update(so, pending.result())

    def _update(self, so: SchedulerOutput, output) -> list[EngineCoreOutput]:
        if output is not None and output.num_compiles:
            self.num_compiles = output.num_compiles
        return self.scheduler.update_from_output(so, output)

    # ---- failed steps -------------------------------------------------------------------------

    def recover(
        self, culprit: str | None, abort_orphans: Callable[[], list[str]]
    ) -> tuple[bool, list[str]]:
        """Undoes a failed step: aborts its requests (``culprit``'s first), evicts what it
        cached, makes the workers consistent. ``abort_orphans`` (the front end's) aborts the
        requests whose completions the core no longer has and returns their ids. Returns
        (whether the KV cache was lost, the aborted request ids)."""
        kv_lost = False
        aborted: list[str] = []
        try:
            self._in_flight = None
            ids = abort_failed_steps(self.scheduler, {culprit} - {None})
            aborted = abort_orphans()  # with the other completions of their prompts
            if self.model_executor.recover_after_failure(ids):
                kv_lost = True
                drop_all_kv(self.scheduler)
        except BaseException:  # noqa: BLE001 - recovery itself broke: start from nothing
            reset_scheduler(self.scheduler)
            kv_lost = self.model_executor.recover_after_failure(None) or kv_lost
        aborted += abort_orphans()  # what a reset aborted
        return kv_lost, aborted

    def make_stats(self):
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        connector = getattr(getattr(self, "scheduler", None), "connector", None)
        if connector is not None:
            connector.shutdown()
        self.model_executor.shutdown()
