"""Host arrays onto the device and results back, in one process or SPMD.

In one process: ``jax.device_put`` (not ``jnp.asarray``, which compiles a small program per
shape) and ``jax.device_get``. Over a mesh whose devices belong to
several processes (a ``jax.distributed`` job where every process runs the same step from the
same ``SchedulerOutput``), host inputs become replicated global arrays built from each
process's identical copy (``jax.make_array_from_process_local_data``), and results are read
from this process's shard of a replicated value.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class HostPlacement:
    """``to_device`` / ``to_host`` / ``zeros`` for the runner's mesh (None: one device)."""

    def __init__(self, mesh: Mesh | None):
        self.replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        self.multi_process = mesh is not None and mesh.is_multi_process

    def to_device(self, host: np.ndarray) -> jax.Array:
        """A host array on the device, replicated over the mesh when there is one (so that it
        has the sharding the compiled programs were built for)."""
        if self.multi_process:
            return jax.make_array_from_process_local_data(self.replicated, host)
        # a copy: on CPU device_put may share the numpy memory, and the host reuses and
        # mutates its arrays
        return jax.device_put(np.array(host), self.replicated)

    def to_host(self, x: jax.Array) -> np.ndarray:
        """A replicated device result on the host: over a multi-process mesh only this
        process's shards are addressable, and each holds the whole value."""
        if not self.multi_process:
            return np.asarray(jax.device_get(x))
        if not x.sharding.is_fully_replicated:
            raise ValueError(f"expected a replicated result, got sharding {x.sharding}")
        return np.asarray(x.addressable_shards[0].data)

    def zeros(self, n: int, dtype) -> jax.Array:
        """[n] zeros of ``dtype`` on the device (on the global mesh when it spans processes)."""
        return self.to_device(np.zeros(n, dtype))
