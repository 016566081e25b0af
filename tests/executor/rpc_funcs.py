"""Functions the executor tests send to worker processes through ``collective_rpc`` (each
takes the ``Worker`` first; they must be importable there, so they live in a light module)."""

from __future__ import annotations

import os
import time


def whoami(worker) -> dict:
    import jax

    return {
        "rank": worker.rank,
        "pid": os.getpid(),
        "process_index": jax.process_index(),
        "local_devices": len(jax.local_devices()),
        "devices": jax.device_count(),
    }


def fail_on_rank(worker, rank: int) -> int:
    if worker.rank == rank:
        raise ValueError(f"bad value on purpose in rank {rank}")
    return worker.rank


def sleep_on_rank(worker, rank: int, seconds: float) -> int:
    if worker.rank == rank:
        time.sleep(seconds)
    return worker.rank


def scale_memory(worker, factors: list) -> int:
    """Makes this worker report its KV budget times ``factors[rank]``."""
    base = worker.determine_available_memory()
    worker.determine_available_memory = lambda: int(base * factors[worker.rank])
    return worker.determine_available_memory()


def holds_config(worker, configs: list) -> bool:
    """Asserts, in the worker, that it holds exactly its rank's KV-cache config and that its
    buffers are that config's size."""
    assert worker.kv_cache_config == configs[worker.rank], (worker.rank, worker.kv_cache_config)
    runner = worker.model_runner
    assert runner.config.num_blocks == configs[worker.rank].num_blocks
    local = runner.buffers[0].addressable_shards
    assert (
        len(local) == 1 and local[0].data.shape[0] == configs[worker.rank].kv_cache_tensors[0].size
    )
    return True


def unpicklable(worker):
    return lambda: worker.rank


def fail_next_dispatch(worker) -> int:
    """This worker's next step raises in dispatch (before any device work), once."""
    real = worker.dispatch

    def failing(scheduler_output):
        worker.dispatch = real
        raise ValueError(f"dispatch failed on purpose in rank {worker.rank}")

    worker.dispatch = failing
    return worker.rank


def fail_next_dispatch_on(worker, rank: int) -> int:
    """Worker ``rank``'s next step raises in dispatch; the others run it (and wait in its
    collectives for the rank that never comes)."""
    if worker.rank == rank:
        fail_next_dispatch(worker)
    return worker.rank


def q_proj_shard(worker) -> tuple[str, list[int]]:
    """Layer 0's q_proj kernel on this worker: its dtype and the shape of its local shard."""
    kernel = worker.model.model.layers[0].self_attn.q_proj.kernel[...]
    return str(kernel.dtype), list(kernel.addressable_shards[0].data.shape)
