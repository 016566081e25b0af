"""A/B of the XLA attention backend: this checkout against another git revision, in ONE process.

    python benchmarks/attention_ab.py [--rev REV] [--new xla|cpu] [--cases a,b] [--rounds N]
        [--layers N] [--json PATH] [--plot]

On shared, noisy cores two separate runs can differ by 20-40%, so the two versions are compiled
side by side and timed in alternating rounds; min and median over the rounds are printed, with
old / new (> 1 means this checkout is faster) and the largest output difference; writes JSON
(default benchmarks/results/attention_ab.json), and with ``--plot`` a PNG next to it (min ms
per case, old vs new). The old ``pallas_kernels/xla_backend.py`` is read with
``git show REV:...`` and imported next to the current one; it shares the rest of
``pallas_kernels`` (tiles, layout) with this checkout, so the A/B is only meaningful while
those helpers keep their signatures.

Each timed call runs the backend ``--layers`` times in one jit (the outputs chained, as layers
are in the engine's step), on the byte view of the cache, as the engine calls it. Shapes:
tiny-llama attention (Hq 8, Hkv 2, D 64, f32, block 16) and a cache with ~2000 spare blocks,
so pages are spread over memory as in a real cache.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench_common as bc  # after ROOT is on sys.path (it imports pallas_kernels)

#: name -> (kind, rows, low, high): decode rows with contexts U[low, high); "shared": decode rows
#: whose block tables all point at row 0's pages (one common prefix, as with prefix caching);
#: prefill: prompts U[low, high) packed to 2048 tokens, no earlier context.
CASES = {
    "decode-64xU64..320": ("decode", 64, 64, 320),
    "decode-64x192": ("decode", 64, 191, 193),
    "decode-256xU16..1024": ("decode", 256, 16, 1024),
    "decode-16x4k": ("decode", 16, 4000, 4096),
    "decode-1x16k": ("decode", 1, 16000, 16384),
    "decode-8xU16..512": ("decode", 8, 16, 512),
    "decode-16x8k-shared": ("shared", 16, 8192, 8193),
    "prefill-2048xU32..256": ("prefill", 64, 32, 257),
}


def load_old(rev: str):
    """The XLA backend module as of ``rev`` (imported under another name)."""
    src = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:pallas_kernels/xla_backend.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "xla_backend_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("xla_backend_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_case(kind: str, rows: int, low: int, high: int):
    import jax.numpy as jnp

    from jaxkv.pallas_kernels.layout import typed_to_bytes
    from jaxkv.pallas_kernels.testing import make_batch

    rng = np.random.default_rng(0)
    if kind in ("decode", "shared"):
        kv = rng.integers(low, high, size=rows).tolist()
        q_lens, tokens, max_q = [1] * rows, rows, 1
    else:
        q_lens = []
        while sum(q_lens) < 2048 - high:
            q_lens.append(int(rng.integers(low, high)))
        q_lens.append(2048 - sum(q_lens))
        kv, tokens, max_q = q_lens, 2048, 2048
    width = max(kv) // 16 + 1
    b = make_batch(
        rng,
        q_lens=q_lens,
        kv_lens=kv,
        block_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=64,
        cache_dtype="float32",
        q_dtype=jnp.float32,
        num_seq_rows=rows,
        num_tokens=tokens,
        max_blocks=width,
        extra_blocks=2000 if sum(kv) < 200_000 else 10,
        fill=0.0,
    )
    args = list(b.attention_args())
    args[1] = typed_to_bytes(args[1])
    if kind == "shared":
        args[4] = jnp.broadcast_to(args[4][:1], args[4].shape)  # every row reads row 0's pages
    return args, max_q


def layered(attention_fn, layers: int, max_q: int):
    """jit of ``layers`` chained calls; call it as f(q, caches, *rest) with one cache per layer
    (distinct buffers, as in the engine: a shared one lets XLA hoist work across layers)."""
    import jax
    import jax.numpy as jnp

    attend = functools.partial(
        attention_fn, sm_scale=0.125, max_q_len=max_q, kv_dtype=jnp.dtype("float32")
    )

    def run(q, caches, *rest):  # q [T, Hq, D]; each "layer" sees a slightly different q
        out = attend(q, caches[0], *rest)
        for i in range(1, layers):
            out = out + attend(q * (1.0 + 1e-3 * i) + 1e-3 * out, caches[i], *rest)
        return out

    return jax.jit(run)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rev", default="HEAD", help="git revision of the old backend (default HEAD)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    p.add_argument(
        "--new",
        default="xla",
        choices=("xla", "cpu"),
        help="this checkout's side: the XLA backend, or the cpu backend (C++ kernel)",
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "attention_ab.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    args = p.parse_args(argv)
    import jax

    from jaxkv.pallas_kernels import xla_backend as new_mod

    old_mod = load_old(args.rev)
    new_fn = new_mod.paged_attention_xla
    if args.new == "cpu":
        from jaxkv.pallas_kernels import cpu_backend

        if not cpu_backend.available():
            p.error(
                f"--new cpu: the CPU attention kernel is unavailable: {cpu_backend.build_error()}"
            )
        new_fn = cpu_backend.paged_attention_cpu
    env = bc.environment()
    workload = dict(
        cases=args.cases,
        rev=args.rev,
        new=args.new,
        layers=args.layers,
        rounds=args.rounds,
        shapes="Hq 8, Hkv 2, D 64, f32, block 16",
    )
    print(
        "\n".join(
            bc.header_lines(
                f"attention A/B: XLA backend at {args.rev} (old) vs this checkout's "
                f"{args.new} backend (new)",
                env,
                workload,
            )
        )
    )
    print("| case | old min / median ms | new min / median ms | old / new (min) | max abs diff |")
    print("|---|---|---|---|---|")
    rows = []
    for name in args.cases.split(","):
        inputs, max_q = make_case(*CASES[name])
        inputs = [inputs[0], [inputs[1] + np.uint8(i) * 0 for i in range(args.layers)], *inputs[2:]]
        fns = {
            "old": layered(old_mod.paged_attention_xla, args.layers, max_q),
            "new": layered(new_fn, args.layers, max_q),
        }
        outs = {k: np.asarray(f(*inputs)) for k, f in fns.items()}  # compiles
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*inputs))
                times[k].append(time.perf_counter() - t0)
        r = {"case": name, "diff": float(np.max(np.abs(outs["old"] - outs["new"])))}
        for k in fns:
            r[f"{k}_min_ms"] = 1e3 * min(times[k])
            r[f"{k}_median_ms"] = 1e3 * float(np.median(times[k]))
        r["speedup"] = r["old_min_ms"] / r["new_min_ms"]
        rows.append(r)
        print(
            f"| {name} | {r['old_min_ms']:.2f} / {r['old_median_ms']:.2f} | "
            f"{r['new_min_ms']:.2f} / {r['new_median_ms']:.2f} | {r['speedup']:.2f}x | "
            f"{r['diff']:.1e} |",
            flush=True,
        )
    print(
        f"# wrote {bc.write_json(args.json, {'env': env, 'workload': workload, 'rows': rows})}",
        file=sys.stderr,
    )
    if args.plot:
        groups = {
            r["case"]: {f"old ({args.rev})": r["old_min_ms"], f"new ({args.new})": r["new_min_ms"]}
            for r in rows
        }
        png = bc.plot_bars(
            pathlib.Path(args.json).with_suffix(".png"),
            bc.plot_title(f"attention A/B, {args.layers} layers", env),
            groups,
            "min ms per call",
        )
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
