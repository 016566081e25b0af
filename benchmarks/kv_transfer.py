"""Pull throughput of TransferAgent between two processes on loopback.

A child process (P) offers ``--repeats`` arrays of each size as ``[size / 64 KiB, 64 KiB]``
uint8 (the KV connector's ``[K, page_bytes]`` layout); this process (D) pulls them one at a
time, polling ``poll_pulled`` every 0.5 ms, and times ``start_pull`` -> arrays ready. One
warm-up pull of 64 KiB first opens the connection (its time is reported apart).

    python benchmarks/kv_transfer.py [--sizes-mib 1 16 64] [--repeats 5]
        [--json benchmarks/results/kv_transfer_cpu.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = 64 << 10
WARMUP_UUID = 1


def uuid_of(size_mib: int, repeat: int) -> int:
    return 1000 * size_mib + repeat + 2


def child(sizes_mib: list[int], repeats: int) -> None:
    """P: offer everything, print the address, serve until stdin closes."""
    import select

    import jax.numpy as jnp

    from jaxkv.distributed.kv_transfer.transfer_agent import TransferAgent

    agent = TransferAgent()
    agent.offer(WARMUP_UUID, [jnp.ones((1, PAGE), jnp.uint8)], hold_timeout_s=600)
    for s in sizes_mib:
        for r in range(repeats):
            x = jnp.full(((s << 20) // PAGE, PAGE), r + 1, jnp.uint8)
            agent.offer(uuid_of(s, r), [x], hold_timeout_s=600)
    print(json.dumps(agent.address), flush=True)
    while not select.select([sys.stdin], [], [], 0.05)[0]:
        agent.poll_sent()
    agent.close()


def pull_once(agent, peer: dict, uuid: int, rows: int) -> float:
    import jax
    import jax.numpy as jnp

    spec = jax.ShapeDtypeStruct(
        (rows, PAGE), jnp.uint8, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    t0 = time.perf_counter()
    agent.start_pull(peer, uuid, [spec], deadline_s=120)
    while True:
        done = agent.poll_pulled()
        if done:
            elapsed = time.perf_counter() - t0
            ((u, result),) = done
            if isinstance(result, BaseException):
                raise result
            return elapsed
        time.sleep(0.0005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.sizes_mib, args.repeats)

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from bench_common import environment, header_lines, table, write_json

    from jaxkv.distributed.kv_transfer.transfer_agent import TransferAgent

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            "--repeats",
            str(args.repeats),
            "--sizes-mib",
            *map(str, args.sizes_mib),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        peer = json.loads(proc.stdout.readline())
        agent = TransferAgent()
        warmup_s = pull_once(agent, peer, WARMUP_UUID, 1)
        rows = []
        for s in args.sizes_mib:
            times = [
                pull_once(agent, peer, uuid_of(s, r), (s << 20) // PAGE)
                for r in range(args.repeats)
            ]
            best, med = min(times), statistics.median(times)
            rows.append(
                {
                    "size_mib": s,
                    "best_ms": best * 1e3,
                    "median_ms": med * 1e3,
                    "best_MiB_per_s": s / best,
                    "median_MiB_per_s": s / med,
                }
            )
        agent.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    e = environment()
    workload = {
        "page_bytes": PAGE,
        "repeats": args.repeats,
        "processes": 2,
        "transport": "jax.experimental.transfer over 127.0.0.1",
        "warmup_pull_ms": round(warmup_s * 1e3, 2),
    }
    print("\n".join(header_lines("TransferAgent pull, two processes on loopback", e, workload)))
    print(table(rows, ["size_mib", "best_ms", "median_ms", "best_MiB_per_s", "median_MiB_per_s"]))
    if args.json:
        write_json(args.json, {"environment": e, "workload": workload, "rows": rows})


if __name__ == "__main__":
    main()
