"""One process of a two-process ``jax.distributed`` job on CPU (run by
``test_load_multiprocess.py``): loads a checkpoint and a random-init model onto a mesh whose
other device belongs to the other process, and checks its own shards against a one-device
load. Usage: ``python load_multiprocess_worker.py PROCESS_ID PORT CHECKPOINT_DIR``.
"""

from __future__ import annotations

import sys

import jax


def main(process_id: int, port: int, checkpoint: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        local_device_ids=[0],
        initialization_timeout=60,
    )
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from jaxkv.models.registry import load_model
    from jaxkv.models.sharding import param_name

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 2, 1)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    for source in (checkpoint, "tiny-hybrid"):
        sharded, _, _ = load_model(source, mesh=mesh, seed=1)
        whole, _, _ = load_model(source, seed=1)  # this process's own device
        want = {
            param_name(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(whole, nnx.Param))
        }
        split = 0
        for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(sharded, nnx.Param)):
            name = param_name(p)
            (shard,) = x.addressable_shards  # one device here, one over there
            assert shard.device.process_index == process_id, name
            got = np.asarray(shard.data)
            assert np.array_equal(got.view(np.uint8), want[name][shard.index].view(np.uint8)), name
            if got.shape != x.shape:
                split += 1
                assert not x.is_fully_addressable, name
        assert split > 0, source
        print(f"process {process_id}: {source}: {split} split parameters match", flush=True)
    print(f"process {process_id}: ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
