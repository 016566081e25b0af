"""Shared parts of the kernel benchmarks: device-side workloads, timing, environment, output.

Workloads are built on the device (jax.random), so large GPU shapes never pass through numpy.
Bandwidth counts the bytes a kernel must read: K and V of every key each query row needs
(sum of seq_lens x Hkv x D x 2 x itemsize) plus q; it is "achieved", not peak.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv.pallas_kernels as pk


@dataclasses.dataclass
class Workload:
    name: str
    kind: str  # "decode" | "mixed"
    num_seqs: int
    context: int  # seq_len of every sequence
    prefill_q: int  # q_len of each prefill chunk (mixed)
    num_prefill: int  # sequences that are prefill chunks (mixed)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    cache_dtype: str = "bfloat16"

    @property
    def q_lens(self) -> list[int]:
        return [self.prefill_q] * self.num_prefill + [1] * (self.num_seqs - self.num_prefill)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)


def make_inputs(w: Workload, seed: int = 0):
    """(q, kv_cache, seq_lens, query_start_loc, block_tables, num_seqs) on the default device."""
    key = jax.random.key(seed)
    kq, kc, kp = jax.random.split(key, 3)
    dt = pk.resolve_kv_dtype(w.cache_dtype)
    blocks = -(-w.context // w.block_size)
    num_blocks = 1 + w.num_seqs * blocks
    cache = jax.random.normal(
        kc,
        pk.kv_cache_shape(num_blocks, w.block_size, w.num_kv_heads, w.head_size, dt),
        jnp.bfloat16,
    ).astype(dt)
    tables = jax.random.permutation(kp, num_blocks - 1)[: w.num_seqs * blocks] + 1
    tables = tables.reshape(w.num_seqs, blocks).astype(jnp.int32)
    q_lens = np.asarray(w.q_lens, np.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q_dtype = jnp.bfloat16
    q = jax.random.normal(kq, (int(q_lens.sum()), w.num_q_heads, w.head_size), q_dtype)
    seq_lens = jnp.full((w.num_seqs,), w.context, jnp.int32)
    return q, cache, seq_lens, qsl, tables, jnp.int32(w.num_seqs)


def bytes_read(w: Workload) -> int:
    """K/V bytes needed (each sequence's keys once per KV head) + q bytes."""
    isz = pk.resolve_kv_dtype(w.cache_dtype).itemsize
    kv = w.num_seqs * w.context * w.num_kv_heads * w.head_size * 2 * isz
    q = sum(w.q_lens) * w.num_q_heads * w.head_size * 2
    return kv + q


def time_fn(fn, *args, repeats: int = 10, warmup: int = 1) -> dict:
    """Median/min seconds over ``repeats`` calls after compiling (compile time reported too)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "first_call_s": first,
        "repeats": repeats,
    }


def environment() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "cpu": cpu,
        "cores": cores,
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def out_dir(arg: str | None) -> pathlib.Path:
    d = pathlib.Path(
        arg
        or os.environ.get("OUT")
        or os.environ.get("JAXKV_BENCH_DIR")
        or pathlib.Path(__file__).parent / "results"
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    directory: pathlib.Path, stem: str, payload: dict, table: str
) -> list[pathlib.Path]:
    js = directory / f"{stem}.json"
    md = directory / f"{stem}.md"
    js.write_text(json.dumps(payload, indent=1, default=str))
    md.write_text(table + "\n")
    return [js, md]
