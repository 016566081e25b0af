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
import pathlib
import sys
import time

import bench_common as bc
import engine_harness as eh
from _throughput_flops import FLOPS_FORMULA, model_matmuls, request_flops
from _throughput_long_decode import run_long_decode
from _throughput_report import headline_figures, plot, print_report
from _throughput_workloads import (
    WORKLOADS,
    Sizes,
    kv_pairs,
    load_model,
    make_requests,
    sizes_from,
)

# The parts of this benchmark: _throughput_workloads.py (sizes, requests, model loading),
# _throughput_flops.py (the FLOP model), _throughput_long_decode.py (the long-decode workload),
# _throughput_report.py (tables, headline figures, plots).

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


# ---- setup and main --------------------------------------------------------------------------


class Context:
    """Objects shared by the workloads of one run (one engine with prefix caching on, one
    with it off for shared-prefix, the baseline, the measured matmul FLOP/s)."""

    def __init__(self, args, workloads):
        self.args = args
        self.model, self.tok = load_model(
            args.model, args.seed, overrides=kv_pairs(args.model_config)
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


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.no_compile_cache:
        from jaxkv import compile_cache

        compile_cache.enable()  # JAXKV_COMPILE_CACHE=off leaves it off
    sz = sizes_from(args.quick, args.sizes)
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
    payload["model_matmuls"] = model_matmuls(
        ctx.cfg, args.max_num_seqs, config["max_num_batched_tokens"], peak
    )
    for res in payload["results"].values():
        for r in res.get("rows", []):
            if "model_flops_per_s" in r:
                r["mfu_pct_of_matmul"] = 100.0 * r["model_flops_per_s"] / peak
    payload["headline"] = headline_figures(payload)
    for res in payload["results"].values():
        for r in res.get("rows", []):
            r.pop("records", None)
    print_report(payload)
    path = bc.write_json(args.json, payload)
    print(f"# wrote {path}")
    if args.plot:
        plot(payload, pathlib.Path(args.json))
    return payload


if __name__ == "__main__":
    main()
