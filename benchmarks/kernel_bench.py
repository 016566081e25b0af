"""CPU table: XLA backend vs interpret-mode Pallas vs jax's reference, decode and mixed batches.

    python benchmarks/kernel_bench.py [OUT_DIR] [--smoke] [--repeats N] [--plot]

OUT_DIR defaults to $OUT, then $JAXKV_BENCH_DIR, then benchmarks/results/. Writes
kernels_cpu.json and kernels_cpu.md there and prints the table; ``--plot`` also writes
kernels_cpu.png (median ms per workload and backend; pallas-interpret left out, being ~100x
slower it would flatten the other bars).

jax's reference (jax.experimental.pallas.ops.gpu.paged_attention.paged_attention_reference) is
decode-only and reads DENSE, contiguous [S, L, Hkv, D] K/V (materialised outside the timing), so
it is the "no paging" baseline (for fp8 workloads it reads the bf16-widened K/V). Interpret-mode
Pallas runs only on the smallest shapes: it
executes the kernel grid program by program (~100x slower than XLA; not a GPU prediction).
CPU numbers on shared, noisy cores: compare ratios within one run, not across runs.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import bench_common as bc
import jax
import jax.numpy as jnp
from _kernel_bench_common import (
    Workload,
    bytes_read,
    make_inputs,
    markdown_table,
    out_dir,
    time_fn,
    write_results,
)
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels.layout import typed_to_bytes

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_size=64)  # Llama-3.2-1B-like attention


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        return [
            Workload("decode-s4-c64", "decode", 4, 64, 1, 0, 4, 2, 64, 16),
            Workload("mixed-s4-c64", "mixed", 4, 64, 16, 1, 4, 2, 64, 16),
        ]
    return [
        Workload("decode-s8-c512", "decode", 8, 512, 1, 0, **HEADS),
        Workload("decode-s32-c1024", "decode", 32, 1024, 1, 0, **HEADS),
        Workload("decode-s64-c2048", "decode", 64, 2048, 1, 0, **HEADS),
        Workload("decode-s32-c1024-fp8", "decode", 32, 1024, 1, 0, **HEADS, cache_dtype="fp8"),
        Workload("mixed-1x128+15-c1024", "mixed", 16, 1024, 128, 1, **HEADS),
        Workload("mixed-2x256+30-c2048", "mixed", 32, 2048, 256, 2, **HEADS),
    ]


def dense_kv(cache, tables, context):
    """[S, L, Hkv, D] K and V from the paged cache (for jax's dense reference)."""
    pages = cache[tables]  # [S, B, 2, Hkv, bs, D]
    s, b, _, h, bs, d = pages.shape
    kv = pages.transpose(2, 0, 1, 4, 3, 5).reshape(2, s, b * bs, h, d)[:, :, :context]
    return kv[0].astype(jnp.bfloat16), kv[1].astype(jnp.bfloat16)


def run(w: Workload, *, repeats: int, interpret_ok: bool) -> list[dict]:
    args = make_inputs(w)
    q, cache, seq_lens = args[0], args[1], args[2]
    sm_scale = w.head_size**-0.5
    scale = 1.0 if w.cache_dtype == "fp8" else None
    nbytes = bytes_read(w)
    # The XLA backend reads the byte view, as the engine calls it: given a typed 8/16-bit view,
    # XLA:CPU hoists the widening convert out of the page loop and copies the whole cache.
    fns = {
        "xla": jax.jit(
            functools.partial(
                pk.paged_attention,
                sm_scale=sm_scale,
                k_scale=scale,
                v_scale=scale,
                max_q_len=w.max_q_len,
                backend="xla",
                kv_dtype=cache.dtype,
            )
        )
    }
    from jaxkv.pallas_kernels import cpu_backend

    if jax.default_backend() == "cpu" and cpu_backend.available():
        # The "cpu" backend (C++ kernel; fp8 caches run the XLA backend), byte view.
        fns["cpu"] = jax.jit(
            functools.partial(
                pk.paged_attention,
                sm_scale=sm_scale,
                k_scale=scale,
                v_scale=scale,
                max_q_len=w.max_q_len,
                backend="cpu",
                kv_dtype=cache.dtype,
            )
        )
    if interpret_ok:
        fns["pallas-interpret"] = jax.jit(
            functools.partial(
                pk.paged_attention,
                sm_scale=sm_scale,
                k_scale=scale,
                v_scale=scale,
                max_q_len=w.max_q_len,
                backend="pallas",
                interpret=True,
            )
        )
    extra = {"xla": (q, jax.block_until_ready(typed_to_bytes(cache)), *args[2:])}
    extra["cpu"] = extra["xla"]
    if w.kind == "decode":
        k, v = dense_kv(cache, args[4], w.context)
        jax.block_until_ready((k, v))
        fns["jax-reference-dense"] = jax.jit(
            lambda q, k, v, l: jax_paged.paged_attention_reference(
                q * jnp.asarray(sm_scale, q.dtype), k, v, l
            )
        )
        extra["jax-reference-dense"] = (q, k, v, seq_lens)
    rows = []
    for name, fn in fns.items():
        reps = 1 if name == "pallas-interpret" else repeats
        t = time_fn(fn, *extra.get(name, args), repeats=reps)
        rows.append(
            {
                "workload": w.name,
                "kind": w.kind,
                "backend": name,
                "cache_dtype": w.cache_dtype,
                "seqs": w.num_seqs,
                "context": w.context,
                "tokens": int(q.shape[0]),
                "ms": t["median_s"] * 1e3,
                "min_ms": t["min_s"] * 1e3,
                "compile+first_s": t["first_call_s"],
                "GB/s": nbytes / t["median_s"] / 1e9,
                "bytes": nbytes,
            }
        )
    base = next(r["ms"] for r in rows if r["backend"] == "xla")
    for r in rows:
        r["x_vs_xla"] = r["ms"] / base
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a test of this script)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    a = p.parse_args(argv)
    env = bc.environment()
    ws = workloads(a.smoke)
    workload = dict(
        workloads=",".join(w.name for w in ws),
        smoke=a.smoke,
        repeats=1 if a.smoke else a.repeats,
        heads=f"q {ws[0].num_q_heads} / kv {ws[0].num_kv_heads}",
        head_size=ws[0].head_size,
        block_size=ws[0].block_size,
        q_dtype="bfloat16",
    )
    print(
        "\n".join(
            bc.header_lines(
                "jaxkv attention kernels: XLA vs cpu vs interpret-mode Pallas vs jax's reference",
                env,
                workload,
            )
        )
    )
    rows = []
    for i, w in enumerate(ws):
        print(f"# {w}", flush=True)
        rows += run(w, repeats=1 if a.smoke else a.repeats, interpret_ok=a.smoke or i in (0, 4))
    cols = [
        "workload",
        "backend",
        "cache_dtype",
        "tokens",
        "ms",
        "min_ms",
        "GB/s",
        "x_vs_xla",
        "compile+first_s",
    ]
    table = markdown_table(rows, cols)
    print(table)
    paths = write_results(
        out_dir(a.out),
        "kernels_cpu_smoke" if a.smoke else "kernels_cpu",
        {
            "environment": env,
            "workload": workload,
            "rows": rows,
            "note": "2 shared noisy CPU cores; GB/s counts K/V+q bytes needed",
        },
        table,
    )
    print("wrote", *paths)
    if a.plot:
        groups = {}
        for r in rows:
            if r["backend"] != "pallas-interpret":
                groups.setdefault(r["workload"], {})[r["backend"]] = r["ms"]
        png = bc.plot_bars(
            pathlib.Path(paths[0]).with_suffix(".png"),
            bc.plot_title(f"paged attention kernels, {env['backend']}", env),
            groups,
            "ms (median)",
        )
        if png:
            print("wrote", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
