"""GPU microbenchmark (run by gpu_check.sh): Pallas kernel vs jax's Pallas paged_attention vs XLA.

    python benchmarks/_kernel_bench_gpu.py OUT_DIR [--smoke] [--repeats N] [--budget-s S] [--aot h200]

Decode and mixed batches, batch 1..256, context 512..32k, bfloat16 and fp8. Columns: time,
achieved HBM bandwidth (K/V + q bytes needed / time; H200 peak ~4.8 TB/s), ratio of jax's
``ops/gpu/paged_attention.paged_attention`` (decode, bfloat16 only; its own layout, converted
outside the timing; q pre-scaled) and of the XLA backend to our kernel, and the max abs
difference of our kernel vs the XLA backend. ``--smoke`` runs tiny shapes in interpret mode on
CPU to test this script. Stops adding workloads when ``--budget-s`` is spent.

``--aot h200`` (``gpu_check.sh``'s dry run, no GPU needed): every workload's functions (ours,
jax's, the XLA backend), with the same arguments, are compiled for a compile-only H200
(``jaxkv.gpu_aot``; inputs are shapes only, nothing is allocated) and not timed; the table
lists each program's temp memory and its Triton kernels (grid, shared memory, registers,
spills), and any error fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
from _kernel_bench_common import (
    Workload,
    bytes_read,
    environment,
    make_inputs,
    markdown_table,
    out_dir,
    time_fn,
    write_results,
)
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

import jaxkv.pallas_kernels as pk

H = dict(num_q_heads=32, num_kv_heads=8, head_size=128)  # Llama-3-8B attention
XLA_MAX_BYTES = 2 << 30  # the gather-based XLA backend materialises f32 K/V: skip beyond this


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        s = dict(num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16)
        return [
            Workload("decode-b2-c64", "decode", 2, 64, 1, 0, **s),
            Workload("decode-b2-c64-fp8", "decode", 2, 64, 1, 0, **s, cache_dtype="fp8"),
            Workload("mixed-1x16+1-c64", "mixed", 2, 64, 16, 1, **s),
        ]
    w = []
    for b, c in [
        (1, 512),
        (1, 32768),
        (16, 4096),
        (64, 4096),
        (64, 32768),
        (256, 512),
        (256, 4096),
    ]:
        w.append(Workload(f"decode-b{b}-c{c}", "decode", b, c, 1, 0, **H))
    for b, c in [(1, 32768), (64, 4096), (256, 4096)]:
        w.append(Workload(f"decode-b{b}-c{c}-fp8", "decode", b, c, 1, 0, **H, cache_dtype="fp8"))
    w.append(Workload("mixed-1x512+63-c4096", "mixed", 64, 4096, 512, 1, **H))
    w.append(Workload("mixed-2x1024+254-c2048", "mixed", 256, 2048, 1024, 2, **H))
    w.append(
        Workload("mixed-1x512+63-c4096-fp8", "mixed", 64, 4096, 512, 1, **H, cache_dtype="fp8")
    )
    return w


def _jax_builtin_inputs(q, cache, seq_lens, tables, *, sm_scale):
    """jax's decode kernel's inputs from ours: [Hkv, N, bs, D] pages, q scaled by the caller,
    the table padded to its block multiple."""
    width = -(-tables.shape[1] // 128) * 128 if tables.shape[1] > 16 else 16
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    return (
        q * jnp.asarray(sm_scale, q.dtype),
        jnp.swapaxes(cache[:, 0], 0, 1),
        jnp.swapaxes(cache[:, 1], 0, 1),
        tables,
        seq_lens,
    )


def jax_builtin(q, cache, seq_lens, tables, *, sm_scale, interpret, shapes_only=False):
    """jax's decode kernel on the same data (``shapes_only``: arguments as ShapeDtypeStructs)."""
    inputs = functools.partial(_jax_builtin_inputs, sm_scale=sm_scale)
    jargs = (
        jax.eval_shape(inputs, q, cache, seq_lens, tables)
        if shapes_only
        else inputs(q, cache, seq_lens, tables)
    )
    width = jargs[3].shape[1]
    k_splits = 16 if width >= 16 else 1
    fn = jax.jit(
        functools.partial(
            jax_paged.paged_attention,
            k_splits=k_splits,
            pages_per_compute_block=min(8, width // k_splits),
            interpret=interpret,
        )
    )
    return fn, jargs


def functions(w: Workload, *, interpret: bool, shapes_only: bool = False) -> dict:
    """name -> (jitted function, its arguments) for workload ``w``: ours, the XLA backend (not
    past XLA_MAX_BYTES on a GPU) and jax's decode kernel (decode, bfloat16)."""
    args = jax.eval_shape(functools.partial(make_inputs, w)) if shapes_only else make_inputs(w)
    q, cache, seq_lens, _, tables, _ = args
    scale = 0.5 if w.cache_dtype == "fp8" else None
    kw = dict(sm_scale=w.head_size**-0.5, k_scale=scale, v_scale=scale, max_q_len=w.max_q_len)
    ours = jax.jit(
        functools.partial(pk.paged_attention, backend="pallas", interpret=interpret, **kw)
    )
    fns = {"pallas": (ours, args)}
    if bytes_read(w) * 3 <= XLA_MAX_BYTES or interpret:
        fns["xla"] = (jax.jit(functools.partial(pk.paged_attention, backend="xla", **kw)), args)
    if w.kind == "decode" and w.cache_dtype == "bfloat16":
        fn, jargs = jax_builtin(
            q,
            cache,
            seq_lens,
            tables,
            sm_scale=kw["sm_scale"],
            interpret=interpret,
            shapes_only=shapes_only,
        )
        if not shapes_only:
            jax.block_until_ready(jargs)
        fns["jax-pallas-paged"] = (fn, jargs)
    return fns


def compile_only(w: Workload, device) -> list[dict]:
    """``--aot``: each of ``functions(w)`` compiled for ``device`` (compile-only), not run."""
    from jaxkv import gpu_aot

    rows = []
    for name, (fn, args) in functions(w, interpret=False, shapes_only=True).items():
        t0 = time.perf_counter()
        compiled, kernels = gpu_aot.compile_with_report(fn, device, *args)
        rows.append(
            {
                "workload": w.name,
                "kind": w.kind,
                "backend": name,
                "cache_dtype": w.cache_dtype,
                "batch": w.num_seqs,
                "context": w.context,
                "tokens": int(args[0].shape[0]),
                "compile_s": time.perf_counter() - t0,
                "temp_MiB": compiled.memory_analysis().temp_size_in_bytes / 2**20,
                "kernels": "; ".join(
                    f"{k.name} grid {list(k.grid)} smem {k.shared_mem_bytes} "
                    f"regs {k.registers} spills {k.spill_bytes}"
                    for k in kernels
                ),
            }
        )
    return rows


def run(w: Workload, *, repeats: int, interpret: bool) -> list[dict]:
    fns = functions(w, interpret=interpret)
    q = fns["pallas"][1][0]
    nbytes = bytes_read(w)
    rows, outs = [], {}
    for name, (fn, a) in fns.items():
        t = time_fn(fn, *a, repeats=repeats)
        outs[name] = fn(*a)
        rows.append(
            {
                "workload": w.name,
                "kind": w.kind,
                "backend": name,
                "cache_dtype": w.cache_dtype,
                "batch": w.num_seqs,
                "context": w.context,
                "tokens": int(q.shape[0]),
                "us": t["median_s"] * 1e6,
                "min_us": t["min_s"] * 1e6,
                "GB/s": nbytes / t["median_s"] / 1e9,
                "compile+first_s": t["first_call_s"],
                "bytes": nbytes,
            }
        )
    base = rows[0]["us"]
    for r in rows:
        r["x_vs_pallas"] = r["us"] / base
        other = outs[r["backend"]]
        r["max_abs_diff_vs_pallas"] = float(
            jnp.max(jnp.abs(other.astype(jnp.float32) - outs["pallas"].astype(jnp.float32)))
        )
    return rows


def view_copy_check(interpret: bool, device=None) -> list[dict]:
    """Does ``kv_cache_view`` of a uint8 buffer feeding attention materialise the cache?

    On XLA:CPU a size-changing bitcast (uint8 -> bf16) is expanded into an elementwise pass
    that is only free when fused into a single gather. A custom call (the Pallas kernel) needs
    its operand materialised: this records temp bytes vs cache bytes per backend (compile only;
    for ``device``, a compile-only GPU, when given).
    """
    bs, hkv, hq, d, s, b = 16, 8, 32, 128, 8, 64
    rows = []
    for dtype in ("bfloat16", "fp8"):
        pb = pk.page_bytes(bs, hkv, d, dtype)
        n = (256 << 20) // pb
        view = functools.partial(
            pk.kv_cache_view, block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype
        )
        for backend in ("pallas", "xla"):

            def step(buf, q, sl, qsl, bt, ns, backend=backend):
                return pk.paged_attention(
                    q,
                    view(buf),
                    sl,
                    qsl,
                    bt,
                    ns,
                    sm_scale=0.1,
                    max_q_len=1,
                    backend=backend,
                    interpret=interpret and backend == "pallas",
                )

            sds, i32 = jax.ShapeDtypeStruct, jnp.int32
            args = (
                sds((n * pb,), jnp.uint8),
                sds((s, hq, d), jnp.bfloat16),
                sds((s,), i32),
                sds((s + 1,), i32),
                sds((s, b), i32),
                sds((), i32),
            )
            if device is None:
                mem = jax.jit(step).lower(*args).compile().memory_analysis()
            else:
                from jaxkv import gpu_aot

                mem = gpu_aot.aot_compile(jax.jit(step), device, *args).memory_analysis()
            rows.append(
                {
                    "check": "view->attention temp",
                    "backend": backend,
                    "cache_dtype": dtype,
                    "cache_MiB": n * pb / 2**20,
                    "temp_MiB": mem.temp_size_in_bytes / 2**20,
                    "copies_cache": mem.temp_size_in_bytes >= 0.5 * n * pb,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument(
        "--aot",
        metavar="TARGET",
        default=None,
        help="compile every workload for this GPU (e.g. h200) without one; nothing is timed",
    )
    a = p.parse_args(argv)
    if a.aot:
        return main_aot(a)
    interpret = jax.default_backend() != "gpu"
    if interpret and not a.smoke:
        print("no GPU: use --smoke (interpret mode, tiny shapes)", file=sys.stderr)
        return 2
    env = environment()
    print(f"# jaxkv GPU kernels on {env['device_kind']} ({env['backend']}); jax {env['jax']}")
    rows, start, skipped = [], time.perf_counter(), []
    for w in workloads(a.smoke):
        if time.perf_counter() - start > a.budget_s:
            skipped.append(w.name)
            continue
        print(f"# {w.name}", flush=True)
        try:
            rows += run(w, repeats=2 if a.smoke else a.repeats, interpret=interpret)
        except Exception as e:  # keep the table going; the error is part of the record
            rows.append({"workload": w.name, "backend": "ERROR", "error": repr(e)[:300]})
            print(f"# {w.name} failed: {e!r}"[:400], flush=True)
    cols = [
        "workload",
        "backend",
        "cache_dtype",
        "tokens",
        "us",
        "GB/s",
        "x_vs_pallas",
        "max_abs_diff_vs_pallas",
        "compile+first_s",
    ]
    table = markdown_table(rows, cols)
    try:
        copies = view_copy_check(interpret)
        table += "\n\n" + markdown_table(
            copies, ["check", "backend", "cache_dtype", "cache_MiB", "temp_MiB", "copies_cache"]
        )
    except Exception as e:  # a record, not a failure of the benchmark
        copies = [{"check": "view->attention temp", "error": repr(e)[:300]}]
    if skipped:
        table += f"\n\nskipped (time budget): {', '.join(skipped)}"
    print(table)
    paths = write_results(
        out_dir(a.out),
        "kernels_gpu_smoke" if a.smoke else "kernels_gpu",
        {"environment": env, "rows": rows, "skipped": skipped, "view_copy_check": copies},
        table,
    )
    print("wrote", *paths)
    return 0


def main_aot(a) -> int:
    """``--aot TARGET``: the full workload list compiled for a compile-only GPU; exit 1 on any
    error (a workload that does not compile, a copied cache)."""
    from jaxkv import gpu_aot

    gpu_aot.prepare_environment()  # before jax starts its backends
    device = gpu_aot.aot_device(a.aot)
    env = environment()
    env["aot_target"] = f"{a.aot} ({device.device_kind}, compile only)"
    print(
        f"# jaxkv GPU kernels compiled for {device.device_kind} (deviceless, not timed); jax {env['jax']}"
    )
    rows, start, skipped, failed = [], time.perf_counter(), [], []
    for w in workloads(a.smoke):
        if time.perf_counter() - start > a.budget_s:
            skipped.append(w.name)
            continue
        print(f"# {w.name}", flush=True)
        try:
            rows += compile_only(w, device)
        except Exception as e:
            failed.append(w.name)
            rows.append({"workload": w.name, "backend": "ERROR", "error": repr(e)[:300]})
            print(f"# {w.name} failed: {e!r}"[:400], flush=True)
    table = markdown_table(
        rows, ["workload", "backend", "cache_dtype", "tokens", "temp_MiB", "compile_s", "kernels"]
    )
    try:
        copies = view_copy_check(False, device)
        table += "\n\n" + markdown_table(
            copies, ["check", "backend", "cache_dtype", "cache_MiB", "temp_MiB", "copies_cache"]
        )
        failed += [
            f"view->attention {r['backend']} {r['cache_dtype']}"
            for r in copies
            if r["copies_cache"]
        ]
    except Exception as e:
        copies = [{"check": "view->attention temp", "error": repr(e)[:300]}]
        failed.append(f"view->attention: {e!r}"[:300])
    if skipped:
        table += f"\n\nskipped (time budget): {', '.join(skipped)}"
    print(table)
    paths = write_results(
        out_dir(a.out),
        f"kernels_gpu_aot_{a.aot}",
        {
            "environment": env,
            "rows": rows,
            "skipped": skipped,
            "view_copy_check": copies,
            "failed": failed,
        },
        table,
    )
    print("wrote", *paths)
    if failed:
        print(f"# failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
