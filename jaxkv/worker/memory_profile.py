"""How much device memory a worker has for its KV cache (vLLM's ``determine_available_memory``).

vLLM runs a profiling forward pass of ``max_num_batched_tokens`` tokens (plus a sampler pass
over ``max_num_seqs`` rows) and reads the peak; JAX answers the same question before anything
runs: a compiled program's ``memory_analysis().temp_size_in_bytes`` is the scratch memory XLA
reserves for it. The programs are lowered with abstract arguments (``jax.ShapeDtypeStruct``
with the arguments' shardings), so no KV cache exists and nothing is allocated for it; temp
memory does not grow with the cache (the buffers are donated and updated in place,
tests/engine/test_step_memory.py), so a placeholder ``num_blocks`` does.

The programs are the engine's own: a ``ModelRunner`` built on a two-block placeholder plan of
the worker's KV specs gives ``jaxkv.worker.step_programs.build_program``, exactly what the
engine compiles later. A step runs its programs one after another, so the budget leaves room
for the largest of them.

Then ``available_kv_bytes``: ``bytes_limit * gpu_memory_utilization - weights - the sampling
state - program temp`` (an explicit ``kv_cache_memory_bytes`` wins; devices without memory
stats, CPU, get a configured budget). The engine core sizes ``num_blocks`` to the smallest
worker's answer (``jaxkv.kv_cache.get_kv_cache_configs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES
from jaxkv.kv_cache import KVCacheSpec, get_kv_cache_config
from jaxkv.models.sharding import TP_AXIS
from jaxkv.worker.model_runner import ModelRunner
from jaxkv.worker.program_set import FORWARD, PROMPT_LOGPROBS, SAMPLE, VERIFY, ProgramKey
from jaxkv.worker.step_programs import build_program

#: Blocks the placeholder plan allocates (block 0 is the null block; 2 is the least a plan has).
_PLACEHOLDER_BLOCKS = 2


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One compiled program's memory on one device (``memory_analysis()``), in bytes."""

    program: str  # its key, e.g. "forward[2048]"
    temp_bytes: int  # XLA's scratch for the program: what the KV budget must leave free
    argument_bytes: int  # weights + KV cache + inputs (the placeholder cache here)
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated inputs (the KV buffers)


def largest_program_keys(runner: ModelRunner) -> list[ProgramKey]:
    """The largest program of each kind the runner can run: the forward and the prompt
    logprobs of the top token bucket, the sampler of the top request bucket and, with
    speculative decoding, the verifier of the most positions."""
    b = runner.buckets
    keys = [ProgramKey(FORWARD, b.tokens[-1]), ProgramKey(SAMPLE, b.seqs[-1])]
    if b.spec:
        keys.append(ProgramKey(VERIFY, b.spec[-1]))
    return keys + [ProgramKey(PROMPT_LOGPROBS, b.tokens[-1])]


def placeholder_runner(
    model,
    kv_cache_specs: Mapping[str, KVCacheSpec],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    mesh=None,
    **runner_kwargs,
) -> ModelRunner:
    """The engine's ``ModelRunner`` on a two-block plan of ``kv_cache_specs`` (arguments as
    :func:`profile_largest_programs`)."""
    plan = get_kv_cache_config(
        kv_cache_specs,
        1 << 62,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks_override=_PLACEHOLDER_BLOCKS,
    )
    return ModelRunner(
        model,
        plan,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        mesh=mesh,
        **runner_kwargs,
    )


def profile_largest_programs(
    model, kv_cache_specs: Mapping[str, KVCacheSpec], *, num_blocks: int | None = None, **kwargs
) -> tuple[StepMemory, ...]:
    """Compiles (never runs) the largest programs the engine can run and reads their memory.

    Args:
      model: the worker's model, its weights loaded (placed on ``mesh`` when given; with
        ``mesh=None`` an ``nnx.eval_shape`` model works too).
      kv_cache_specs: this worker's ``{layer name: spec}`` (its own KV heads under TP).
      num_blocks: the cache size (blocks per device) the programs are compiled for, default the
        two-block placeholder; no cache of that size is allocated. Temp memory does not depend
        on it (measured: 2 to 5000 blocks, the same bytes; tests/worker/test_memory_profile.py).
      kwargs: ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``mesh`` and the
        rest of the engine's ``ModelRunner`` arguments (attention_backend, cache_dtype,
        speculative_config, max_logprobs, ...), so the profiled programs are the engine's.

    Returns:
      One ``StepMemory`` per program (per device: an SPMD program's analysis is one device's).
    """
    runner = placeholder_runner(model, kv_cache_specs, **kwargs)
    out = []
    for key in largest_program_keys(runner):
        ma = compile_program(runner, key, num_blocks=num_blocks).memory_analysis()
        out.append(
            StepMemory(
                program=str(key),
                temp_bytes=int(ma.temp_size_in_bytes),
                argument_bytes=int(ma.argument_size_in_bytes),
                output_bytes=int(ma.output_size_in_bytes),
                alias_bytes=int(ma.alias_size_in_bytes),
            )
        )
    return tuple(out)


def largest_step_temp_bytes(model, kv_cache_specs: Mapping[str, KVCacheSpec], **kwargs) -> int:
    """The temp memory of the largest program the engine will compile, per device: the max of
    ``profile_largest_programs(model, kv_cache_specs, **kwargs)``'s ``temp_bytes`` (same
    arguments). What ``available_kv_bytes`` subtracts, as vLLM subtracts its profiled peak."""
    return max(
        step.temp_bytes for step in profile_largest_programs(model, kv_cache_specs, **kwargs)
    )


def compile_program(
    runner: ModelRunner, key: ProgramKey, *, num_blocks: int | None = None, binding=None
):
    """``runner``'s program ``key`` lowered with abstract arguments and compiled for the
    runner's devices; ``num_blocks``: for KV buffers of that many blocks per device instead of
    the runner's own (none of that size is allocated); ``binding``: another attention binding
    (``jaxkv.gpu_aot``: the Pallas kernels). Returns the ``jax.stages.Compiled``."""
    blocks = runner.config.num_blocks if num_blocks is None else num_blocks
    if blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {blocks}")
    shards = 1 if runner.mesh is None else runner.mesh.shape[TP_AXIS]
    buffers = tuple(
        jax.ShapeDtypeStruct(
            (shards * blocks * runner.page_bytes // b.dtype.itemsize,), b.dtype, sharding=b.sharding
        )
        for b in runner.buffers
    )  # uint8 | uint32
    program = build_program(runner, key, binding=binding, buffers=buffers)
    return (
        jax.jit(program.fn, donate_argnums=program.donate_argnums)
        .lower(*program.abstract_args())
        .compile()
    )


def device_weight_bytes(model_or_state) -> int:
    """Bytes of parameters on the fullest of this process's devices (each device counts only
    its own shards; a replicated parameter counts on every device)."""
    per_device: dict = {}
    for x in jax.tree_util.tree_leaves(model_or_state):
        for shard in getattr(x, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def available_kv_bytes(
    device_memory_stats: Mapping[str, int] | None,
    *,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    weights_bytes: int,
    step_temp_bytes: int,
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES,
) -> int:
    """Bytes this worker's KV cache may take on one device, with vLLM's semantics.

    ``kv_cache_memory_bytes`` wins when given. Else, a device with memory stats (jax's
    ``device.memory_stats()``): ``int(bytes_limit * gpu_memory_utilization) - weights_bytes -
    step_temp_bytes``. A device without them (CPU): ``cpu_kv_cache_bytes``.

    Example: an 80 GiB limit at 0.9 with 16 GiB of weights and 2 GiB of step temp leaves
    72 - 16 - 2 = 54 GiB.

    Raises:
      TypeError: a byte count that is not an int.
      ValueError: a negative count, a utilization outside (0, 1], or nothing left for the KV
        cache (the message prints each term).
    """
    for name, value in (
        ("weights_bytes", weights_bytes),
        ("step_temp_bytes", step_temp_bytes),
        ("cpu_kv_cache_bytes", cpu_kv_cache_bytes),
        ("kv_cache_memory_bytes", kv_cache_memory_bytes),
    ):
        if value is None and name == "kv_cache_memory_bytes":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {kv_cache_memory_bytes}")
        return int(kv_cache_memory_bytes)
    if not device_memory_stats or "bytes_limit" not in device_memory_stats:
        if cpu_kv_cache_bytes <= 0:
            raise ValueError(f"cpu_kv_cache_bytes must be positive, got {cpu_kv_cache_bytes}")
        return int(cpu_kv_cache_bytes)
    if (
        isinstance(gpu_memory_utilization, bool)
        or not isinstance(gpu_memory_utilization, (int, float))
        or not 0.0 < gpu_memory_utilization <= 1.0
    ):
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    limit = int(device_memory_stats["bytes_limit"])
    requested = int(limit * gpu_memory_utilization)
    available = requested - int(weights_bytes) - int(step_temp_bytes)
    if available <= 0:
        raise ValueError(
            f"no device memory left for the KV cache: bytes_limit {limit} x gpu_memory_utilization "
            f"{gpu_memory_utilization} = {requested}, minus weights {weights_bytes}, minus the "
            f"largest step's temp memory {step_temp_bytes} = {available} bytes. Raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or use more "
            f"devices (tensor_parallel_size)"
        )
    return available
