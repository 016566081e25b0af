"""Every program of a Llama-3-8B-sized engine compiled for an NVIDIA H200, deviceless: how long
warm-up's compiles take for a real model on the GPU, measured on this CPU-only machine.

    python benchmarks/gpu_aot_programs.py [--layers 32] [--max-num-seqs 64]
        [--max-num-batched-tokens 2048] [--workers 2] [--json PATH]

The model is Llama-3-8B's shape (hidden 4096, MLP 14336, 32 / 8 heads of 128, vocabulary
128256, bf16), its weights abstract (``nnx.eval_shape``: nothing the size of the model is
allocated); the engine's ``ModelRunner`` on the Pallas backend gives its program set
(``program_keys()``), and each program is compiled for the H200 with the Pallas Triton
kernels lowered (``jaxkv.gpu_aot.compile_runner_program``), over ``--workers`` threads as
the engine's warm-up does. XLA's GPU compile is CPU work: the seconds are this machine's,
not a GPU host's. Needs the deviceless tier's wheels (``jaxkv.gpu_aot``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import sys
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before jax starts its backends

import bench_common as bc


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "gpu_aot_programs.json"))
    args = p.parse_args(argv)

    import jax
    from flax import nnx

    from jaxkv import gpu_aot
    from jaxkv.engine import LLMEngine
    from jaxkv.models import build_model, get_config

    cfg = get_config(
        "tiny-llama",
        num_hidden_layers=args.layers,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=args.max_model_len,
        dtype="bfloat16",
    )
    model = nnx.eval_shape(lambda: build_model(cfg, seed=0))
    engine = LLMEngine.from_config(
        model,
        attention_backend="pallas",
        warmup=False,
        compile_cache=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        # one max_model_len request's KV: 8 heads x 128 x K,V x bf16 a layer
        kv_cache_memory_bytes=args.layers * 4096 * args.max_model_len + (16 << 20),
    )
    runner, dev = engine.runner, gpu_aot.aot_device("h200")
    keys = runner.program_keys()
    env = bc.environment()
    workload = dict(
        model=f"Llama-3-8B-sized ({args.layers} layers, bf16, abstract weights)",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        target="H200 (deviceless)",
        workers=args.workers,
        programs=len(keys),
        token_buckets=list(runner.buckets.tokens),
        seq_buckets=list(runner.buckets.seqs),
    )
    print(
        "\n".join(
            bc.header_lines("warm-up's programs compiled for an H200, deviceless", env, workload)
        ),
        flush=True,
    )
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only: nothing to read back
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()

    def one(key):
        t = time.perf_counter()
        gpu_aot.compile_runner_program(runner, dev, key)
        seconds[str(key)] = time.perf_counter() - t
        print(f"{key}: {seconds[str(key)]:.1f} s", file=sys.stderr, flush=True)

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        for f in [pool.submit(one, k) for k in keys]:
            f.result()
    wall = time.perf_counter() - t0
    by_kind = collections.defaultdict(float)
    for name, s in seconds.items():
        by_kind[name.split("[")[0]] += s
    summary = {
        "programs": len(keys),
        "wall_s": round(wall, 1),
        "compile_s_sum": round(sum(seconds.values()), 1),
        "by_kind_s": {k: round(v, 1) for k, v in by_kind.items()},
        "slowest": max(seconds, key=seconds.get),
        "slowest_s": round(max(seconds.values()), 1),
    }
    print(bc.table([summary], list(summary), "summary"))
    bc.write_json(
        args.json,
        {"environment": env, "workload": workload, "summary": summary, "per_program_s": seconds},
    )
    return summary


if __name__ == "__main__":
    main()
