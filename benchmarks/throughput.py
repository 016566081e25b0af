"""Offline throughput of jaxkv vs a naive JAX baseline, on seeded synthetic workloads.

    python benchmarks/throughput.py [--workload fixed|mixed|shared-prefix|long-decode|all]
        [--quick] [--model tiny-llama] [--max-num-seqs 64] [--max-num-batched-tokens N]
        [--kv-cache-memory 512MiB] [--async-scheduling] [--no-baseline] [--json PATH] [--plot]
    jaxkv bench ...   (same arguments)

Workloads (full size; ``--quick`` scales each down, see QUICK):
  fixed          64 requests, prompts U[32, 256], 64 output tokens each
  mixed          256 requests, prompts U[32, 512], outputs U[16, 256]
  shared-prefix  64 requests = one 1024-token system prompt + U[32, 128] private tokens,
                 64 output tokens; prefix caching on vs off
  long-decode    decode step time vs context 1k..16k at batch 1 and 16, and the same step on a
                 256 MiB vs a 4 GiB KV cache
All greedy, EOS ignored, all requests arrive at t=0. The engine is warmed up
(``runner.warmup()`` + one untimed pass of the same requests, so the timed pass compiles
nothing); the naive baseline compiles every shape ahead. Compile time is reported apart.
CPU numbers on shared cores are noisy: compare the ratios of one run, not runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import pathlib
import statistics
import sys
import time

import numpy as np

import bench_common as bc
import engine_harness as eh

FLOPS_FORMULA = (
    "model FLOPs = 2 * P_nonembed * computed_tokens + 2 * hidden * vocab * output_tokens "
    "(LM head, one row per sampled token) + 4 * layers * q_heads * head_dim * sum(context "
    "of each computed token); computed_tokens = prompt - prefix_hit + output - 1"
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    fixed_n: int = 64
    fixed_prompt: tuple = (32, 256)
    fixed_out: int = 64
    mixed_n: int = 256
    mixed_prompt: tuple = (32, 512)
    mixed_out: tuple = (16, 256)
    shared_n: int = 64
    shared_len: int = 1024
    shared_private: tuple = (32, 128)
    shared_out: int = 64
    contexts: tuple = (1024, 2048, 4096, 8192, 16384)
    decode_batches: tuple = (1, 16)
    decode_steps: int = 16
    kv_compare_context: int = 4096


FULL = Sizes()
QUICK = Sizes(
    fixed_n=32,
    fixed_prompt=(32, 128),
    fixed_out=32,
    mixed_n=64,
    mixed_prompt=(32, 256),
    mixed_out=(8, 64),
    shared_n=16,
    shared_len=256,
    shared_private=(16, 64),
    shared_out=16,
    contexts=(1024, 2048),
    decode_steps=6,
    kv_compare_context=1024,
)
WORKLOADS = ("fixed", "mixed", "shared-prefix", "long-decode")
KV_COMPARE_ROUNDS = 3  # alternating small / large KV-cache measurements


# ---- workloads and FLOPs ----------------------------------------------------------------------


def make_requests(name: str, sz: Sizes, vocab: int, seed: int) -> tuple[list, list, dict]:
    rng = np.random.default_rng(seed)
    if name == "fixed":
        lens = rng.integers(sz.fixed_prompt[0], sz.fixed_prompt[1] + 1, sz.fixed_n)
        prompts = [eh.seeded_tokens(rng, int(n), vocab) for n in lens]
        outs = [sz.fixed_out] * sz.fixed_n
        desc = dict(
            requests=sz.fixed_n, prompt_len=f"U{list(sz.fixed_prompt)}", output_len=sz.fixed_out
        )
    elif name == "mixed":
        lens = rng.integers(sz.mixed_prompt[0], sz.mixed_prompt[1] + 1, sz.mixed_n)
        prompts = [eh.seeded_tokens(rng, int(n), vocab) for n in lens]
        outs = rng.integers(sz.mixed_out[0], sz.mixed_out[1] + 1, sz.mixed_n).tolist()
        desc = dict(
            requests=sz.mixed_n,
            prompt_len=f"U{list(sz.mixed_prompt)}",
            output_len=f"U{list(sz.mixed_out)}",
        )
    elif name == "shared-prefix":
        shared = eh.seeded_tokens(rng, sz.shared_len, vocab)
        lens = rng.integers(sz.shared_private[0], sz.shared_private[1] + 1, sz.shared_n)
        prompts = [shared + eh.seeded_tokens(rng, int(n), vocab) for n in lens]
        outs = [sz.shared_out] * sz.shared_n
        desc = dict(
            requests=sz.shared_n,
            shared_prefix=sz.shared_len,
            private_len=f"U{list(sz.shared_private)}",
            output_len=sz.shared_out,
        )
    else:
        raise ValueError(name)
    desc.update(seed=seed, sampling="greedy, ignore_eos")
    return prompts, [int(o) for o in outs], desc


def nonembed_params(cfg) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_attention_heads * d * 2 + h * cfg.num_key_value_heads * d * 2
    return cfg.num_hidden_layers * (attn + 3 * h * cfg.intermediate_size)


def request_flops(cfg, prompt_len: int, output_len: int, cached: int = 0) -> float:
    """Useful model FLOPs of one request (see FLOPS_FORMULA)."""
    first, last = cached, prompt_len + output_len - 2  # positions computed (inclusive)
    tokens = max(0, last - first + 1)
    ctx_sum = (last + 1) * (last + 2) // 2 - first * (first + 1) // 2  # sum of (p + 1)
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * ctx_sum
    return (
        2.0 * nonembed_params(cfg) * tokens
        + 2.0 * cfg.hidden_size * cfg.vocab_size * output_len
        + attn
    )


# ---- one workload -----------------------------------------------------------------------------


def summarize_run(system: str, res: dict, prompts, outs, flops: float, peak_flops: float) -> dict:
    n = len(prompts)
    useful_out = sum(outs)
    el = res["elapsed_s"]
    ttft, tpot = bc.summarize(res["ttft_s"]), bc.summarize(res["tpot_s"])
    row = {
        "system": system,
        "requests": n,
        "elapsed_s": el,
        "req_per_s": n / el,
        "output_tok_per_s": useful_out / el,
        "total_tok_per_s": (useful_out + sum(map(len, prompts))) / el,
        "ttft_ms_mean": _ms(ttft["mean"]),
        "ttft_ms_median": _ms(ttft["median"]),
        "ttft_ms_p99": _ms(ttft["p99"]),
        "tpot_ms_mean": _ms(tpot["mean"]),
        "tpot_ms_median": _ms(tpot["median"]),
        "tpot_ms_p99": _ms(tpot["p99"]),
        "model_flops": flops,
        "model_flops_per_s": flops / el,
        "mfu_pct_of_matmul": 100.0 * flops / el / peak_flops if peak_flops else None,
    }
    for k in (
        "peak_kv_usage",
        "preemptions",
        "compiles",
        "compile_s",
        "prefix_hit_tokens",
        "scheduled_tokens",
        "generated_tokens",
        "warm_pass",
        "padded_token_slots",
        "elapsed_all_s",
        "spec_draft_tokens",
        "spec_accepted_tokens",
    ):
        if k in res:
            row[k] = res[k]
    if "peak_kv_usage" in res:
        row["peak_kv_pct"] = 100.0 * res["peak_kv_usage"]
    return row


def _median_pass(runs: list[dict], name: str, system: str) -> dict:
    """The pass with the median elapsed time; all passes' times are kept in it."""
    times = [r["elapsed_s"] for r in runs]
    res = sorted(runs, key=lambda r: r["elapsed_s"])[len(runs) // 2]
    res["elapsed_all_s"] = times
    if len(runs) > 1:
        print(
            f"# [{name}] {system} passes: "
            + ", ".join(f"{t:.2f}" for t in times)
            + " s (median pass reported)",
            file=sys.stderr,
        )
    return res


def _ms(s):
    return None if s is None else 1e3 * s


def run_throughput_workload(name, ctx, sz: Sizes) -> dict:
    prompts, outs, desc = make_requests(name, sz, ctx.cfg.vocab_size, ctx.args.seed)
    cfg, peak = ctx.cfg, ctx.peak_flops
    print(f"# [{name}] {desc}", file=sys.stderr)
    result = {"workload": desc, "rows": []}
    # Timed passes of jaxkv and the baseline alternate (drift on shared cores hits both alike);
    # each system reports its median pass.
    runs, base_runs = [], []
    for i in range(ctx.args.repeats):
        if i and not ctx.engine.scheduler.reset_prefix_cache():
            raise RuntimeError("could not reset the prefix cache between timed passes")
        runs.append(eh.run_workload(ctx.engine, ctx.timer, prompts, outs, warm_pass=i == 0))
        if ctx.naive is not None:
            base_runs.append(ctx.naive.generate(prompts, outs))
    res = _median_pass(runs, name, "jaxkv")
    flops = sum(
        request_flops(cfg, len(p), o, c) for p, o, c in zip(prompts, outs, res["cached_tokens"])
    )
    row = summarize_run("jaxkv", res, prompts, outs, flops, peak)
    row["host"] = eh.host_breakdown(res["records"])
    big = max((r.num_reqs for r in res["records"] if r.decode_only), default=0)
    row["host_decode"] = dict(batch=big, **eh.host_breakdown(res["records"], batch=big))
    result["rows"].append(row)
    jaxkv_tokens = res["tokens"]
    if name == "shared-prefix":
        off = eh.run_workload(ctx.engine_off, ctx.timer_off, prompts, outs)
        off_flops = sum(request_flops(cfg, len(p), o) for p, o in zip(prompts, outs))
        row_off = summarize_run("jaxkv (prefix cache off)", off, prompts, outs, off_flops, peak)
        row_off["host"] = eh.host_breakdown(off["records"])
        result["rows"].append(row_off)
        prompt_total = sum(map(len, prompts))
        pre_on = res["scheduled_tokens"] - (res["generated_tokens"] - len(prompts))
        pre_off = off["scheduled_tokens"] - (off["generated_tokens"] - len(prompts))
        shared_blocks = sz.shared_len // ctx.engine.config.block_size * ctx.engine.config.block_size
        result["prefix"] = {
            "prompt_tokens": prompt_total,
            "prefill_tokens_computed_on": pre_on,
            "prefill_tokens_computed_off": pre_off,
            "prefix_hit_tokens": res["prefix_hit_tokens"],
            "prefill_saved_pct": 100.0 * (1 - pre_on / pre_off) if pre_off else None,
            "ideal_saved_pct": 100.0 * (len(prompts) - 1) * shared_blocks / prompt_total,
            "speedup_on_vs_off": off["elapsed_s"] / res["elapsed_s"],
            "tokens_equal_on_off": off["tokens"] == res["tokens"],
        }
    if ctx.naive is not None:
        b = _median_pass(base_runs, name, "naive-jax")
        row_b = summarize_run(
            "naive-jax",
            b,
            prompts,
            outs,
            sum(request_flops(cfg, len(p), o) for p, o in zip(prompts, outs)),
            peak,
        )
        row_b["compile_s"] = ctx.naive.compile_seconds
        row_b["padding_waste_pct"] = 100.0 * (
            1 - (sum(map(len, prompts)) + sum(outs)) / b["padded_token_slots"]
        )
        result["rows"].append(row_b)
        same = sum(a == c for a, c in zip(jaxkv_tokens, b["tokens"]))
        result["baseline_tokens_equal"] = f"{same}/{len(prompts)}"
        result["jaxkv_over_baseline"] = row["output_tok_per_s"] / row_b["output_tok_per_s"]
    return result


# ---- long decode ------------------------------------------------------------------------------


def run_long_decode(ctx, sz: Sizes) -> dict:
    args, cfg = ctx.args, ctx.cfg
    max_ctx = max(sz.contexts)
    model, tok = load_model(
        args.model, args.seed, max_pos=max_ctx, overrides=_kv_pairs(args.model_config)
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
    try:  # small and large in alternating rounds (this VM's speed drifts by up to ~2x within a
        # minute): the ratio of the two medians over the rounds, and the paired per-round ratios
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
    except (ValueError, MemoryError, RuntimeError) as e:  # noqa: PERF203
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


# ---- setup and output -------------------------------------------------------------------------


def load_model(name: str, seed: int, max_pos: int | None = None, overrides: dict | None = None):
    """(model, tokenizer). Random-init configs take ``overrides`` (``--model-config``) and get
    ``max_position_embeddings >= max_pos`` (positions do not change the weights: same seed,
    same parameters)."""
    from jaxkv.models import build_model, get_config, load_model as _load
    from jaxkv.models.registry import RANDOM_INIT_NAMES

    if name in RANDOM_INIT_NAMES and (max_pos or overrides):
        cfg = get_config(name, **(overrides or {}))
        cfg = dataclasses.replace(
            cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_pos or 0)
        )
        return build_model(cfg, seed=seed), None
    if overrides:
        raise ValueError(f"--model-config applies to random-init models only, not {name!r}")
    model, _, tok = _load(name, seed=seed)
    return model, tok


def _kv_pairs(text: str | None) -> dict:
    """'a=1,b=2:3' -> {'a': 1, 'b': (2, 3)} (ints; ':' separates tuple items)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        k, v = item.split("=")
        out[k.strip()] = tuple(int(x) for x in v.split(":")) if ":" in v else int(v)
    return out


class Context:
    """Objects shared by the workloads of one run (one engine with prefix caching on, one
    with it off for shared-prefix, the baseline, the measured matmul FLOP/s)."""

    def __init__(self, args, workloads):
        self.args = args
        self.model, self.tok = load_model(
            args.model, args.seed, overrides=_kv_pairs(args.model_config)
        )
        self.cfg = self.model.config
        self.peak_flops = None
        self.engine = self.engine_off = self.naive = None
        self.compile = {}
        kw = dict(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=args.kv_cache_memory,
            attention_backend=args.attention_backend,
            seed=args.seed,
            async_scheduling=args.async_scheduling,
            speculative_config=args.speculative_ngram,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        if any(w != "long-decode" for w in workloads):
            self.engine, self.timer = self._warm(kw, "prefix caching on")
        if "shared-prefix" in workloads:
            self.engine_off, self.timer_off = self._warm(
                dict(kw, enable_prefix_caching=False), "prefix caching off"
            )
        if not args.no_baseline:
            if self.cfg.architecture == "llama":
                from naive_jax import NaiveJaxLlama

                self.naive = NaiveJaxLlama(self.model, batch_size=args.max_num_seqs)
            else:
                print(
                    f"# baseline: naive JAX covers the llama family only, not {self.cfg.architecture}",
                    file=sys.stderr,
                )

    def _warm(self, kw, label):
        engine, timer = eh.build_engine(self.model, self.tok, **kw)
        t0 = time.perf_counter()
        engine.runner.warmup(progress=False)
        self.compile[label] = {
            "warmup_s": time.perf_counter() - t0,
            "warmup_compiles": engine.runner.num_compiles,
        }
        print(
            f"# engine ({label}) warmup: {engine.runner.num_compiles} programs, "
            f"{self.compile[label]['warmup_s']:.1f} s",
            file=sys.stderr,
        )
        return engine, timer


def _model_matmuls(cfg, decode_rows: int, prefill_rows: int | None, peak: float) -> dict | None:
    """XLA's FLOP/s on the model's own matmul chain at a decode step's and a prefill step's
    rows (``bench_common.model_matmul_flops``): the ceiling for MFU with XLA's dots here.
    Skipped for models whose fp32 weights would not fit comfortably (> 2 GiB)."""
    weight_bytes = 4 * (nonembed_params(cfg) + cfg.hidden_size * cfg.vocab_size)
    if weight_bytes > 2 * 2**30 or not prefill_rows:
        return None
    out = {
        "decode": bc.model_matmul_flops(cfg, decode_rows, lm_head=True),
        "prefill": bc.model_matmul_flops(cfg, prefill_rows, lm_head=False),
    }
    for r in out.values():
        r["pct_of_matmul_probe"] = 100.0 * r["flops_per_s"] / peak
    return out


def print_report(payload: dict) -> None:
    env = payload["env"]
    print("\n".join(bc.header_lines("jaxkv offline throughput", env, payload["config"])))
    mm = payload["matmul"]
    print(
        f"# matmul probe: {mm['n']}x{mm['n']} fp32 jnp.dot, best of {mm['repeats']}: "
        f"{mm['flops_per_s'] / 1e9:.1f} GFLOP/s at the start, "
        f"{payload['matmul_end']['flops_per_s'] / 1e9:.1f} at the end; MFU uses the higher"
    )
    chain = payload.get("model_matmuls")
    if chain:
        d, p = chain["decode"], chain["prefill"]
        print(
            f"# the model's own matmul chain in XLA (random fp32 weights, no attention / cache): "
            f"{d['rows']} rows + LM head {d['flops_per_s'] / 1e9:.1f} GFLOP/s "
            f"({d['pct_of_matmul_probe']:.0f}% of the probe), {p['rows']} rows "
            f"{p['flops_per_s'] / 1e9:.1f} GFLOP/s ({p['pct_of_matmul_probe']:.0f}%)"
        )
    print(f"# {FLOPS_FORMULA}")
    rows, summary = [], []
    for name, res in payload["results"].items():
        if name == "long-decode":
            continue
        for r in res["rows"]:
            rows.append(
                dict(
                    r,
                    workload=name,
                    **{
                        "GFLOP/s": r["model_flops_per_s"] / 1e9,
                        "host%": r.get("host", {}).get("host_pct"),
                    },
                )
            )
        if "jaxkv_over_baseline" in res:
            summary.append(
                {
                    "workload": name,
                    "jaxkv/baseline out tok/s": res["jaxkv_over_baseline"],
                    "greedy tokens equal": res["baseline_tokens_equal"],
                }
            )
    if rows:
        print(
            bc.table(
                rows,
                [
                    "workload",
                    "system",
                    "requests",
                    "elapsed_s",
                    "req_per_s",
                    "output_tok_per_s",
                    "total_tok_per_s",
                    "GFLOP/s",
                    "mfu_pct_of_matmul",
                    "peak_kv_pct",
                    "preemptions",
                    "compiles",
                    "host%",
                ],
                "throughput",
            )
        )
        print(
            bc.table(
                rows,
                [
                    "workload",
                    "system",
                    "ttft_ms_mean",
                    "ttft_ms_median",
                    "ttft_ms_p99",
                    "tpot_ms_mean",
                    "tpot_ms_median",
                    "tpot_ms_p99",
                    "compile_s",
                ],
                "latency",
            )
        )
        host = [
            dict(workload=n, **r["host_decode"])
            for n, res in payload["results"].items()
            if n != "long-decode"
            for r in res["rows"]
            if "host_decode" in r
        ]
        print(
            bc.table(
                host,
                [
                    "workload",
                    "batch",
                    "steps",
                    "step_ms_median",
                    "host_pct",
                    "schedule_pct",
                    "prepare_pct",
                    "update_pct",
                    "device_pct",
                ],
                "jaxkv decode steps at the largest batch (host = step - device)",
            )
        )
    sp = payload["results"].get("shared-prefix", {}).get("prefix")
    if sp:
        print(bc.table([sp], list(sp), "shared-prefix: prefix caching"))
    ld = payload["results"].get("long-decode")
    if ld:
        print(
            bc.table(
                ld["rows"],
                [
                    "context",
                    "batch",
                    "jaxkv_step_ms",
                    "jaxkv_device_ms",
                    "width_blocks",
                    "measured_steps",
                    "naive_step_ms",
                    "jaxkv_speedup",
                ],
                "long-decode: decode step time",
            )
        )
        print(
            bc.table(
                [ld["kv_size_compare"]], list(ld["kv_size_compare"]), "decode step vs KV-cache size"
            )
        )
    if summary:
        print(bc.table(summary, list(summary[0]), "jaxkv / naive JAX baseline"))
    print(bc.table(payload["targets"], ["target", "measured", "met"], "targets (this CPU)"))


def targets(payload: dict) -> list[dict]:
    res = payload["results"]
    out = []

    def add(name, value, ok):
        out.append({"target": name, "measured": value, "met": ok})

    for w, need in (("fixed", 1.3), ("mixed", 2.0)):
        r = res.get(w, {}).get("jaxkv_over_baseline")
        if r is not None:
            add(f"{w}: jaxkv >= {need}x naive JAX", f"{r:.2f}x", r >= need)
    f = res.get("fixed", {}).get("rows", [{}])[0].get("mfu_pct_of_matmul")
    if f is not None:
        add("fixed: model FLOP/s >= 60% of matmul", f"{f:.1f}%", f >= 60)
    chain = payload.get("model_matmuls")
    if chain:
        add(
            "(context) XLA on the model's matmuls alone, decode / prefill rows",
            f"{chain['decode']['pct_of_matmul_probe']:.0f}% / {chain['prefill']['pct_of_matmul_probe']:.0f}%"
            " of matmul",
            None,
        )
    sp = res.get("shared-prefix", {}).get("prefix")
    if sp:
        add(
            "shared-prefix: prefill saved ~ shared fraction",
            f"{bc.fmt(sp['prefill_saved_pct'])}% (ideal {bc.fmt(sp['ideal_saved_pct'])}%), "
            f"speedup {sp['speedup_on_vs_off']:.2f}x",
            None,
        )
    for w in ("fixed", "mixed"):
        hd = res.get(w, {}).get("rows", [{}])[0].get("host_decode", {})
        if hd.get("steps"):
            add(
                f"{w}: host < 10% of decode step (batch {hd['batch']})",
                f"{hd['host_pct']:.1f}%",
                hd["host_pct"] < 10 if hd["batch"] >= 64 else None,
            )
    kv = res.get("long-decode", {}).get("kv_size_compare", {})
    if kv.get("large_over_small"):
        add(
            "decode step: large vs small KV cache within 10%",
            f"{kv['large_over_small']:.3f}x",
            abs(kv["large_over_small"] - 1) <= 0.10,
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    from jaxkv.entrypoints.cli import parse_bytes, parse_ngram

    p = argparse.ArgumentParser(
        prog="jaxkv bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    p.add_argument("--workload", default="all", choices=WORKLOADS + ("all",))
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("512MiB"))
    p.add_argument(
        "--kv-compare",
        type=lambda s: tuple(parse_bytes(x) for x in s.split(",")),
        default=(256 * 2**20, 4 * 2**30),
        help="long-decode: two KV budgets (default 256MiB,4GiB)",
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="jaxkv schedules step N+1 while step N runs (see benchmarks/async_ab.py)",
    )
    p.add_argument(
        "--speculative-ngram",
        type=parse_ngram,
        default=None,
        metavar="K[,MAX[,MIN]]",
        help="n-gram speculative decoding: K drafts a step, lookup n-grams MAX..MIN "
        "(default 4..1); e.g. 3 or 3,4,1",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="jaxkv on N devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N); "
        "the naive baseline stays on one",
    )
    p.add_argument("--quick", action="store_true", help="scaled-down workloads (see QUICK)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "throughput.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write PNGs next to the JSON (needs matplotlib)"
    )
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use the persistent XLA compile cache (~/.cache/jaxkv/xla)",
    )
    p.add_argument(
        "--matmul-n", type=int, default=2048, help="size of the fp32 matmul FLOP/s probe"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed passes per system (alternating); the median pass is reported",
    )
    p.add_argument(
        "--model-config",
        default=None,
        metavar="K=V,...",
        help="config overrides for a random-init model, e.g. num_hidden_layers=2,hidden_size=128",
    )
    p.add_argument(
        "--sizes",
        default=None,
        metavar="K=V,...",
        help="override workload sizes (fields of Sizes; tuples as lo:hi), e.g. fixed_n=8,contexts=64:128",
    )
    return p


def _sizes(args) -> Sizes:
    sz = QUICK if args.quick else FULL
    kw = _kv_pairs(args.sizes)
    for k, v in kw.items():
        if isinstance(getattr(sz, k), tuple) and isinstance(v, int):
            kw[k] = (v,)
    return dataclasses.replace(sz, **kw)


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.no_compile_cache:
        from jaxkv import compile_cache

        compile_cache.enable()  # JAXKV_COMPILE_CACHE=off leaves it off
    sz = _sizes(args)
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    env = bc.environment()
    mm = bc.matmul_flops(args.matmul_n)
    t_setup = time.perf_counter()
    ctx = Context(args, workloads)
    ctx.peak_flops = mm["flops_per_s"]
    setup_s = time.perf_counter() - t_setup
    config = dict(
        model=args.model,
        dtype=ctx.cfg.dtype,
        workloads=",".join(workloads),
        quick=args.quick,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=ctx.engine.config.max_num_batched_tokens
        if ctx.engine
        else args.max_num_batched_tokens,
        kv_cache_memory_MiB=args.kv_cache_memory // 2**20,
        num_blocks=ctx.engine.kv_cache_config.num_blocks if ctx.engine else None,
        block_size=ctx.engine.config.block_size if ctx.engine else None,
        backend=ctx.engine.runner.backend if ctx.engine else args.attention_backend,
        async_scheduling=args.async_scheduling,
        speculative=args.speculative_ngram,
        tensor_parallel_size=args.tensor_parallel_size,
        baseline="naive-jax" if ctx.naive else "none",
    )
    payload = {
        "env": env,
        "config": config,
        "sizes": dataclasses.asdict(sz),
        "matmul": mm,
        "flops_formula": FLOPS_FORMULA,
        "setup": dict(seconds=setup_s, **ctx.compile),
        "results": {},
    }
    for w in workloads:
        t0 = time.perf_counter()
        payload["results"][w] = (
            run_long_decode(ctx, sz) if w == "long-decode" else run_throughput_workload(w, ctx, sz)
        )
        payload["results"][w]["wall_s"] = time.perf_counter() - t0
    mm_end = bc.matmul_flops(
        args.matmul_n
    )  # again at the end: shared cores drift; MFU uses the best
    payload["matmul_end"] = mm_end
    peak = max(mm["flops_per_s"], mm_end["flops_per_s"])
    payload["matmul_flops_per_s_used"] = peak
    payload["model_matmuls"] = _model_matmuls(
        ctx.cfg, args.max_num_seqs, config["max_num_batched_tokens"], peak
    )
    for res in payload["results"].values():
        for r in res.get("rows", []):
            if "model_flops_per_s" in r:
                r["mfu_pct_of_matmul"] = 100.0 * r["model_flops_per_s"] / peak
    payload["targets"] = targets(payload)
    for res in payload["results"].values():
        for r in res.get("rows", []):
            r.pop("records", None)
    print_report(payload)
    path = bc.write_json(args.json, payload)
    print(f"# wrote {path}")
    if args.plot:
        _plot(payload, pathlib.Path(args.json))
    return payload


def _plot(payload, json_path: pathlib.Path) -> None:
    groups = {
        n: {r["system"]: r["output_tok_per_s"] for r in res["rows"]}
        for n, res in payload["results"].items()
        if n != "long-decode"
    }
    title = f"{payload['config']['model']} on {payload['env']['cpu']} x{payload['env']['cores']}"
    written = []
    if groups:
        written.append(
            bc.plot_bars(json_path.with_suffix(".png"), title, groups, "output tokens/s")
        )
    ld = payload["results"].get("long-decode")
    if ld:
        series = {}
        for b in sorted({r["batch"] for r in ld["rows"]}):
            rs = [r for r in ld["rows"] if r["batch"] == b]
            series[f"jaxkv batch {b}"] = (
                [r["context"] for r in rs],
                [r["jaxkv_step_ms"] for r in rs],
            )
            if "naive_step_ms" in rs[0]:
                series[f"naive batch {b}"] = (
                    [r["context"] for r in rs],
                    [r["naive_step_ms"] for r in rs],
                )
        written.append(
            bc.plot_lines(
                json_path.with_name(json_path.stem + "_long_decode.png"),
                title,
                series,
                "context (tokens)",
                "decode step (ms)",
            )
        )
    for w in written:
        if w:
            print(f"# wrote {w}")


if __name__ == "__main__":
    main()
