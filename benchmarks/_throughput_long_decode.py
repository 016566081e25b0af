"""The throughput benchmark's long-decode workload: decode step time vs context at a few batch
sizes, and the same step on a small vs a large KV cache.

Requests of one measurement share their context prefix through prefix caching (its prefill is
paid once); each still attends its full context.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import bench_common as bc
import engine_harness as eh
import numpy as np
from _throughput_workloads import Sizes, kv_pairs, load_model

KV_COMPARE_ROUNDS = 3  # alternating small / large KV-cache measurements


def run_long_decode(ctx, sz: Sizes) -> dict:
    """``ctx``: the run's ``throughput.Context`` (its args, model config and baseline)."""
    args, cfg = ctx.args, ctx.cfg
    max_ctx = max(sz.contexts)
    model, tok = load_model(
        args.model, args.seed, max_pos=max_ctx, overrides=kv_pairs(args.model_config)
    )
    if model.config.max_position_embeddings < max_ctx:
        contexts = tuple(c for c in sz.contexts if c <= model.config.max_position_embeddings)
        print(
            f"# [long-decode] {args.model} supports {model.config.max_position_embeddings} positions: "
            f"contexts {contexts}",
            file=sys.stderr,
        )
    else:
        contexts = sz.contexts
    max_ctx = max(contexts)
    rng = np.random.default_rng(args.seed + 1)
    stream = eh.seeded_tokens(rng, max_ctx, cfg.vocab_size)
    tail, steps = 16, sz.decode_steps
    batches = sz.decode_batches
    budget = args.max_num_batched_tokens or 2048

    def room(b):  # decode tokens a request may take: the measured steps + the steps
        return steps + 4 + -(-b * 2 * tail // budget)  # its batch needs to prefill the tails

    def prompts_for(c, b):  # shared prefix (prefix caching pays its prefill once) + private tails
        return [
            stream[: c - room(b) - tail] + eh.seeded_tokens(rng, tail, cfg.vocab_size)
            for _ in range(b)
        ]

    def measure(engine, timer, c, b):
        return eh.decode_step_times(engine, timer, prompts_for(c, b), steps, room(b))

    kw = dict(
        max_num_seqs=max(batches),
        max_model_len=max_ctx,
        attention_backend=args.attention_backend,
        max_num_batched_tokens=args.max_num_batched_tokens or 2048,
    )
    small, large = args.kv_compare
    engine, timer = eh.build_engine(model, tok, kv_cache_memory_bytes=small, **kw)
    rows = []
    for c in contexts:
        for b in batches:
            t0 = time.perf_counter()
            r = measure(engine, timer, c, b)
            row = {
                "context": c,
                "batch": b,
                "jaxkv_step_ms": r["step_ms_median"],
                "jaxkv_device_ms": r.get("device_ms_median"),
                "measured_steps": r["steps"],
                "wall_s": time.perf_counter() - t0,
            }
            if ctx.naive is not None:
                row["naive_step_ms"] = 1e3 * ctx.naive.decode_step_time(b, c, steps)
                row["jaxkv_speedup"] = (
                    row["naive_step_ms"] / row["jaxkv_step_ms"] if row["jaxkv_step_ms"] else None
                )
            print(
                f"# [long-decode] context {c} batch {b}: {bc.fmt(row['jaxkv_step_ms'])} ms/step",
                file=sys.stderr,
            )
            rows.append(row)
    cc = min(sz.kv_compare_context, max_ctx)
    bcmp = max(batches)
    compare = {
        "context": cc,
        "batch": bcmp,
        "small_MiB": small // 2**20,
        "large_MiB": large // 2**20,
        "small_blocks": engine.kv_cache_config.num_blocks,
        "rounds": KV_COMPARE_ROUNDS,
    }
    try:  # small and large in alternating rounds (a shared VM's speed can drift by up to ~2x
        # within a minute): the ratio of the two medians over the rounds, and the paired
        # per-round ratios
        eng_l, timer_l = eh.build_engine(model, tok, kv_cache_memory_bytes=large, **kw)
        compare["large_blocks"] = eng_l.kv_cache_config.num_blocks
        measure(engine, timer, cc, 1)  # primes the prefixes
        measure(eng_l, timer_l, cc, 1)
        small_ms, large_ms = [], []
        for _ in range(KV_COMPARE_ROUNDS):
            small_ms.append(measure(engine, timer, cc, bcmp)["step_ms_median"])
            large_ms.append(measure(eng_l, timer_l, cc, bcmp)["step_ms_median"])
        del eng_l, timer_l
        gc.collect()
        compare.update(small_step_ms=small_ms, large_step_ms=large_ms)
        if all(small_ms) and all(large_ms):
            compare["large_over_small"] = statistics.median(large_ms) / statistics.median(small_ms)
            compare["paired_ratios"] = [lg / sm for lg, sm in zip(large_ms, small_ms)]
    except (ValueError, MemoryError, RuntimeError) as e:
        compare["large_error"] = str(e)
    del engine, timer
    gc.collect()
    return {
        "workload": dict(
            contexts=list(contexts),
            batches=list(batches),
            decode_steps=steps,
            private_tail=tail,
            note="requests share their context prefix through "
            "prefix caching (prefill paid once); each still attends its full context",
        ),
        "rows": rows,
        "kv_size_compare": compare,
    }
