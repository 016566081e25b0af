"""A TransferAgent in its own process, driven line by line over stdin (the tests' other side).

Commands (one JSON list per line):
    ["offer", uuid, rows, cols, hold_s, sharded]   -> offers pattern(uuid, rows, cols)
    ["pull", uuid, rows, cols, deadline_s, sharded, peer_address]
    ["quit"]                                        -> closes the agent, exits 0
Events (one JSON list per line on stdout):
    ["address", {...}] first; then ["done", uuid], ["expired", uuid],
    ["pulled", uuid, ok: bool, detail] (detail: "equal" / "differs" / the exception).
Sharded arrays are [rows, cols] uint8 split over the columns on a 1-D "tp" mesh of all local
devices (run with XLA_FLAGS=--xla_force_host_platform_device_count=2 for two).
"""

from __future__ import annotations

import json
import select
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv.distributed.kv_transfer.transfer_agent import TransferAgent


def pattern(uuid: int, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] uint8, different for every uuid."""
    return (
        ((np.arange(rows * cols, dtype=np.uint64) * 31 + uuid * 7) % 251)
        .astype(np.uint8)
        .reshape(rows, cols)
    )


def sharding(sharded: bool):
    if sharded:
        return NamedSharding(Mesh(np.array(jax.devices()), ("tp",)), PartitionSpec(None, "tp"))
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def emit(*event) -> None:
    sys.stdout.write(json.dumps(list(event)) + "\n")
    sys.stdout.flush()


def main() -> None:
    agent = TransferAgent()
    emit("address", agent.address)
    expected = {}
    while True:
        if select.select([sys.stdin], [], [], 0.01)[0]:
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd[0] == "quit":
                break
            if cmd[0] == "offer":
                _, uuid, rows, cols, hold_s, sharded = cmd
                x = jax.device_put(pattern(uuid, rows, cols), sharding(sharded))
                agent.offer(uuid, [x], hold_timeout_s=hold_s)
            elif cmd[0] == "pull":
                _, uuid, rows, cols, deadline_s, sharded, peer = cmd
                spec = jax.ShapeDtypeStruct((rows, cols), jnp.uint8, sharding=sharding(sharded))
                agent.start_pull(peer, uuid, [spec], deadline_s=deadline_s)
                expected[uuid] = (rows, cols, sharded)
        done, expired = agent.poll_sent()
        for u in sorted(done):
            emit("done", u)
        for u in sorted(expired):
            emit("expired", u)
        for u, result in agent.poll_pulled():
            if isinstance(result, BaseException):
                emit("pulled", u, False, f"{type(result).__name__}: {result}")
                continue
            rows, cols, sharded = expected[u]
            equal = np.array_equal(np.asarray(result[0]), pattern(u, rows, cols))
            same_sharding = result[0].sharding.is_equivalent_to(sharding(sharded), 2)
            emit("pulled", u, True, "equal" if equal and same_sharding else "differs")
    agent.close()


if __name__ == "__main__":
    main()
