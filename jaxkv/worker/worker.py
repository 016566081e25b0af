"""Worker (vLLM V1's ``Worker``): one rank's device set-up around its ``ModelRunner``.

The executor calls, in order: ``init_device`` (devices and the ``"tp"`` mesh), ``load_model``
(weights created on the mesh shard by shard: no device holds a whole split parameter),
``get_kv_cache_spec`` and ``determine_available_memory`` (what the engine core builds the
per-rank KV-cache plans from), ``initialize_from_config`` with this rank's plan (the runner
allocates the flat uint8 buffers and binds the per-layer views), ``compile_or_warm_up_model``,
then ``execute_model`` (or ``dispatch`` / ``collect``) once per step.
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES
from jaxkv.kv_cache import KVCacheConfig, kv_cache_specs_from_layers
from jaxkv.models.sharding import make_tp_mesh
from jaxkv.worker.memory_profile import (
    available_kv_bytes,
    device_weight_bytes,
    largest_step_temp_bytes,
)
from jaxkv.worker.model_runner import ModelRunner
from jaxkv.worker.sampling_state import state_bytes


class Worker:
    """One worker rank.

    Args:
      config: the engine's ``EngineConfig``.
      rank: global rank (its ``KVCacheConfig`` is the engine core's ``configs[rank]``).
      local_rank: rank on this host.
      model: an NNX model already built in this process (``LLM(model_object)``); else the
        worker loads ``config.model`` itself.
    """

    def __init__(self, config, *, rank: int = 0, local_rank: int = 0, model=None):
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.model = model
        self.model_config = model.config if model is not None else None
        self.mesh = None
        self.devices: list = []  # this process's devices of the worker (init_device)
        self.kv_cache_config: KVCacheConfig | None = None
        self.model_runner: ModelRunner | None = None
        self.kv_connector = None  # the worker side of the KV connector (kv_transfer_config)

    # ---- start-up -----------------------------------------------------------------------------

    def init_device(self) -> None:
        """The ``"tp"`` mesh over ``tensor_parallel_size`` devices (None for one device) and
        this process's devices of it (``devices``: whose memory the worker measures)."""
        cache = getattr(self.config, "compile_cache_dir", None)
        if cache:  # before the first compile of this process (the weights' init)
            from jaxkv.compile_cache import enable

            enable(cache)
        tp = self.config.tensor_parallel_size
        self.mesh = make_tp_mesh(tp) if tp > 1 else None
        self.devices = (
            list(self.mesh.local_devices) if self.mesh is not None else [jax.local_devices()[0]]
        )

    def load_model(self) -> None:
        """Loads ``config.model`` onto the mesh (``init_device`` first): each parameter is
        created already split, shard by shard (a checkpoint's shards read from the file, a
        random init jitted onto its shardings). A model given to the constructor is kept
        (the runner places it on the mesh). On one CPU device with AMX or AVX512-BF16, bf16
        linear layers are then packed (``jaxkv.models.cpu_layout``; a copy of a given
        model's)."""
        if self.model is None:
            from jaxkv.models.registry import load_model  # lazy: the engine depends on models

            self.model, self.model_config, _ = load_model(
                self.config.model,
                dtype=self.config.dtype,
                seed=self.config.seed,
                mesh=self.mesh,
                quantization=getattr(self.config, "quantization", None),
            )
        if self.mesh is None:  # bf16 linears packed where the CPU has AMX or AVX512-BF16
            from jaxkv.models.cpu_layout import pack_for_cpu

            self.model = pack_for_cpu(self.model)

    def get_kv_cache_spec(self) -> dict:
        """``{layer name: KVCacheSpec}`` of this rank's share of the KV heads."""
        c = self.config
        return kv_cache_specs_from_layers(
            per_device_layers(self.model, self.model_config, c.tensor_parallel_size),
            block_size=c.block_size,
            cache_dtype=c.cache_dtype,
        )

    def device_memory_stats(self) -> dict | None:
        """``memory_stats()`` of this worker's device with the smallest ``bytes_limit``, or
        None when a device reports none (CPU)."""
        stats = []
        for device in self.devices:
            try:
                s = device.memory_stats()
            except Exception:  # noqa: BLE001 - some backends raise instead of returning None
                s = None
            if not s or "bytes_limit" not in s:
                return None
            stats.append(s)
        return min(stats, key=lambda s: s["bytes_limit"], default=None)

    def determine_available_memory(self) -> int:
        """Bytes for this rank's KV cache on each of its devices (vLLM's): an explicit
        ``kv_cache_memory_bytes`` wins; else, on a device with memory stats, ``bytes_limit x
        gpu_memory_utilization`` minus this device's weights minus the temp memory of the
        largest step (read from that step's compiled ``memory_analysis()``, no profiling run:
        ``jaxkv.worker.memory_profile``); on a device without (CPU) the default budget."""
        c = self.config
        stats = self.device_memory_stats() if c.kv_cache_memory_bytes is None else None
        weights = temp = 0
        if stats is not None:
            weights = device_weight_bytes(self.model) + state_bytes(
                c.max_num_seqs + 1, self.model_config.vocab_size, c.max_model_len
            )
            temp = largest_step_temp_bytes(
                self.model,
                self.get_kv_cache_spec(),
                max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
                max_model_len=c.max_model_len,
                mesh=self.mesh,
                **self._runner_kwargs(),
            )
        elif c.kv_cache_memory_bytes is None and c.verbose:
            print(
                f"jaxkv: device reports no memory stats; KV cache budget "
                f"{DEFAULT_CPU_KV_CACHE_BYTES / 2**20:.0f} MiB (set kv_cache_memory_bytes)",
                file=sys.stderr,
            )
        available = available_kv_bytes(
            stats,
            gpu_memory_utilization=c.gpu_memory_utilization,
            kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            weights_bytes=weights,
            step_temp_bytes=temp,
            cpu_kv_cache_bytes=DEFAULT_CPU_KV_CACHE_BYTES,
        )
        if stats is not None:  # a prefill instance's offered copies live beside the cache
            from jaxkv.distributed.kv_transfer.transfer_connector import kv_bytes_beside_offers

            available = kv_bytes_beside_offers(available, getattr(c, "kv_transfer_config", None))
        if stats is not None and c.verbose:
            print(
                f"jaxkv: rank {self.rank}: {stats['bytes_limit'] / 2**30:.2f} GiB x "
                f"{c.gpu_memory_utilization} - weights and sampling state {weights / 2**30:.2f} GiB"
                " - largest step's temp "
                f"{temp / 2**30:.2f} GiB = {available / 2**30:.2f} GiB for the KV cache",
                file=sys.stderr,
            )
        return available

    def _runner_kwargs(self) -> dict:
        """The ``ModelRunner`` arguments besides the model and the plan (the profiled step
        is the one the engine compiles)."""
        c = self.config
        return dict(
            attention_backend=c.attention_backend,
            cache_dtype=c.cache_dtype,
            seed=c.seed,
            eos_token_id=c.eos_token_ids[0] if c.eos_token_ids else None,
            speculative_config=c.speculative_config,
            logprobs_mode=c.logprobs_mode,
            max_logprobs=c.max_logprobs,
        )

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Builds the runner on this rank's plan: its buffers are allocated here."""
        c = self.config
        self.kv_cache_config = kv_cache_config
        self.model_runner = ModelRunner(
            self.model,
            kv_cache_config,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len,
            mesh=self.mesh,
            **self._runner_kwargs(),
        )
        if getattr(c, "kv_transfer_config", None) is not None:
            self._init_kv_connector()

    def _init_kv_connector(self) -> None:
        """The worker-side connector, registered with the runner's paged buffers."""
        from jaxkv.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole
        from jaxkv.worker.kv_connector import ConnectorHooks, PagedKVCaches

        connector = KVConnectorFactory.create_connector(
            self.config.kv_transfer_config,
            KVConnectorRole.WORKER,
            self.kv_cache_config,
            rank=self.rank,
            world_size=jax.process_count(),
        )
        self.kv_pages = PagedKVCaches(self.model_runner)
        connector.register_kv_caches(self.kv_pages)
        self.kv_connector = connector
        self.model_runner.kv_connector_hooks = ConnectorHooks(connector)

    def get_kv_connector_handshake(self) -> dict | None:
        """This worker's ``get_handshake_metadata()`` for the scheduler-side connector."""
        return self.kv_connector.get_handshake_metadata() if self.kv_connector is not None else None

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    def compile_or_warm_up_model(self) -> int:
        """Compiles every program the engine can run (``warmup``; a pooling-only engine's
        never sample) and, with a KV connector, its page gathers and scatters, so nothing
        compiles while it works. Returns the programs compiled so far."""
        c = self.config
        if c.warmup:
            progress = c.verbose or sys.stderr.isatty()  # a terminal sees the compiles progress
            self.model_runner.warmup(progress=progress, generate=c.runner != "pooling")
            if self.kv_connector is not None:
                self.kv_pages.warm_up()
        return self.model_runner.num_compiles

    # ---- steps --------------------------------------------------------------------------------

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def dispatch(self, scheduler_output):
        return self.model_runner.dispatch(scheduler_output)

    def collect(self, handle):
        return self.model_runner.collect(handle)

    def recover_after_failure(self, req_ids: list[str] | None) -> bool:
        """See ``ModelRunner.recover_after_failure``; ``None`` forgets every request."""
        runner = self.model_runner
        return runner.recover_after_failure(list(runner.requests) if req_ids is None else req_ids)

    def runner_stats(self) -> dict:
        r = self.model_runner
        return dict(
            num_compiles=r.num_compiles,
            compile_seconds=r.compile_seconds,
            late_compiles=list(r.programs.late_compiles),
            num_programs=len(r.program_keys()),
            num_draft_tokens=r.num_draft_tokens,
            num_accepted_tokens=r.num_accepted_tokens,
        )


def per_device_layers(model, model_config, tp: int) -> dict:
    """The model's ``kv_layer_infos()`` with each layer's KV heads split over ``tp`` devices
    (vLLM sizes each worker's cache by its own heads). ValueError when a head count does not
    divide by ``tp`` (vLLM would replicate KV heads there; jaxkv does not)."""
    infos = model.kv_layer_infos()
    if tp == 1:
        return infos
    heads = getattr(model_config, "num_attention_heads", None)
    if heads is not None and heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={heads}")
    for name, info in infos.items():
        if info.num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the {info.num_kv_heads} "
                f"KV heads of {name} (jaxkv does not replicate KV heads)"
            )
    return {
        name: dataclasses.replace(info, num_kv_heads=info.num_kv_heads // tp)
        for name, info in infos.items()
    }
