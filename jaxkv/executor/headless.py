"""The headless launcher (vLLM's ``--headless``): a node other than node 0 of a multi-node
job starts only its worker processes and waits for node 0's engine core
(``jaxkv.executor.multiproc.MultiprocExecutor``) to drive them and, at its end, stop them.

``jaxkv generate --headless ...`` runs it, and so does ``python -m jaxkv.executor.headless
--headless --nnodes 2 --node-rank 1 --master-addr HOST0 --master-port 29500 -tp 2``, whose
flags are ``EngineArgs``' (the same names, defaults and help as ``jaxkv generate``'s).
"""

from __future__ import annotations

import signal
import sys
import time

from jaxkv.entrypoints.cli_common import Parser, name_flags
from jaxkv.entrypoints.engine_args import EngineArgs
from jaxkv.executor.multiproc import default_platform, start_worker, stop_processes
from jaxkv.executor.worker_proc import SpawnArgs

#: The ``EngineArgs`` flags of the launcher: where this node is in the job.
HEADLESS_FLAGS = (
    "headless",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "tensor_parallel_size",
    "devices_per_worker",
)


def run_headless(
    *,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    tensor_parallel_size: int,
    devices_per_worker: int = 1,
    platform: str | None = None,
    init_timeout_s: int = 180,
) -> int:
    """Starts node ``node_rank``'s workers of a job whose engine core runs on node 0, and waits
    for them; returns their exit status (0 when the executor shut them down). A failed worker
    stops the node's others. SIGTERM / SIGINT stop them too."""
    if not 0 < node_rank < nnodes:
        raise ValueError(
            f"a headless node has 0 < node_rank < nnodes, got node_rank={node_rank}, nnodes={nnodes}"
        )
    if not master_port:
        raise ValueError("a headless node needs --master-port (node 0's)")
    world = tensor_parallel_size // devices_per_worker
    if tensor_parallel_size % (devices_per_worker * nnodes):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must split evenly over "
            f"nnodes={nnodes} with {devices_per_worker} device(s) per worker"
        )
    local = world // nnodes
    procs = []
    for local_rank in range(local):
        procs.append(
            start_worker(
                SpawnArgs(
                    rank=node_rank * local + local_rank,
                    local_rank=local_rank,
                    world_size=world,
                    coordinator_address=f"{master_addr}:{master_port}",
                    control_address=f"tcp://{master_addr}:{master_port + 1}",
                    platform=platform or default_platform(),
                    devices_per_worker=devices_per_worker,
                    init_timeout_s=init_timeout_s,
                )
            )
        )

    def stop(signum, frame):
        stop_processes(procs, grace_s=0.5)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return max(abs(c) for c in codes)
            if any(c not in (None, 0) for c in codes):
                stop_processes(procs, grace_s=0.5)
                return max(abs(p.returncode) for p in procs)
            time.sleep(0.2)
    finally:
        stop_processes(procs, grace_s=0.5)


def main(argv=None) -> int:
    p = Parser(
        prog="python -m jaxkv.executor.headless",
        description="Runs this node's jaxkv worker processes (vLLM's --headless).",
    )
    EngineArgs.add_cli_args(p, HEADLESS_FLAGS)
    args = EngineArgs.from_cli_args(p.parse_args(argv))
    args.distributed_executor_backend = "mp"
    try:
        if not args.headless:
            raise ValueError("headless is required: this launcher only runs a node's workers")
        args.check(engine=False)
        return run_headless(
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            tensor_parallel_size=args.tensor_parallel_size,
            devices_per_worker=args.devices_per_worker,
        )
    except (ValueError, TypeError) as e:
        p.error(name_flags(e, EngineArgs.flag_names()))


if __name__ == "__main__":
    sys.exit(main())
