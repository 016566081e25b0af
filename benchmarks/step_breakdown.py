"""Where a step's time goes on this machine: attention vs the rest, decode vs prefill, host vs device.

Runs the `fixed`-like workload (64 requests, prompts U[32, 256], 40 greedy tokens) on tiny-llama
three times in fresh processes: as is, with paged attention replaced by the identity (so the
difference is attention), and with the KV write removed. Reports median device time of
pure-decode steps at batch 64 and of full 2048-token prefill steps, plus the host share.

    python benchmarks/step_breakdown.py [--json benchmarks/results/step_breakdown.json] [--plot]

Writes JSON, and with ``--plot`` a PNG next to it (the summary's milliseconds: decode and
prefill step, attention, KV write). The variants change the model's math, so only their
times mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import bench_common as bc
import numpy as np

VARIANTS = ("full", "no-attention", "no-kv-write")
WORKLOAD = dict(
    model="tiny-llama",
    dtype="float32",
    requests=64,
    prompt="U[32,256]",
    max_tokens=40,
    greedy=True,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    kv_cache_MiB=256,
    variants=",".join(VARIANTS),
    measured="pass 2 of 2, steps that compile skipped",
)


def _child(variant: str) -> dict:
    import jaxkv.models.attention as attn

    if variant == "no-attention":
        attn.paged_attention = lambda q, *a, **k: q
    elif variant == "no-kv-write":
        attn.write_kv = lambda buf, *a, **k: buf
    from jaxkv import LLM, SamplingParams

    llm = LLM(
        "tiny-llama",
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=512,
    )
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    records, dispatch, fetch = [], runner.dispatch, runner._fetch
    pending = {}

    def timed_dispatch(so):
        compiles, t0 = runner.num_compiles, time.perf_counter()
        handle = dispatch(so)
        fresh = runner.num_compiles != compiles  # a compile: not a step time
        pending["t"] = None if fresh or handle is None else time.perf_counter() - t0
        pending["plan"] = None if handle is None else handle.plan
        return handle

    def timed_fetch(results):
        t0 = time.perf_counter()
        host = fetch(results)
        plan = pending.get("plan")
        if pending.get("t") is not None and plan is not None:
            records.append(
                (int(plan.q_lens.max()), plan.num_tokens, pending["t"] + time.perf_counter() - t0)
            )
        return host

    runner.dispatch, runner._fetch = timed_dispatch, timed_fetch
    for rep in range(
        2
    ):  # pass 0 warms the host path; pass 1 is measured (a step that compiles is skipped)
        records.clear()
        for i in range(64):
            engine.add_request(
                f"{rep}-{i}",
                rng.integers(3, 32000, size=int(rng.integers(32, 257))).tolist(),
                params,
            )
        step_s = []
        while engine.has_unfinished_requests():
            compiles, t0 = runner.num_compiles, time.perf_counter()
            engine.step()
            if runner.num_compiles == compiles:
                step_s.append(time.perf_counter() - t0)
    decode = [t for q, _, t in records if q == 1][3:]
    prefill = [t for q, n, t in records if q > 1 and n == 2048]
    device = sum(t for _, _, t in records)
    return {
        "decode_device_ms": 1e3 * float(np.median(decode)),
        "prefill_2048_device_ms": 1e3 * float(np.median(prefill)) if prefill else None,
        "host_pct": 100 * (1 - device / sum(step_s)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "step_breakdown.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    results = {}
    for v in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", v],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, JAXKV_COMPILE_CACHE="off"),
        )
        results[v] = json.loads(out.stdout.strip().splitlines()[-1])
    full, noattn, nowrite = (results[v] for v in VARIANTS)
    summary = {
        "decode_step_ms": full["decode_device_ms"],
        "decode_attention_ms": full["decode_device_ms"] - noattn["decode_device_ms"],
        "decode_kv_write_ms": full["decode_device_ms"] - nowrite["decode_device_ms"],
        "prefill_step_ms": full["prefill_2048_device_ms"],
        "prefill_attention_ms": (full["prefill_2048_device_ms"] - noattn["prefill_2048_device_ms"])
        if full["prefill_2048_device_ms"] and noattn["prefill_2048_device_ms"]
        else None,
        "host_pct_of_step_time": full["host_pct"],
    }
    env = bc.environment()
    print(
        "\n".join(
            bc.header_lines(
                "where a step's time goes: batch 64 decode / 2048-token prefill steps",
                env,
                WORKLOAD,
            )
        )
    )
    print("| quantity | ms (or %) |\n|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v:.1f} |" if v is not None else f"| {k} | - |")
    payload = {"env": env, "workload": WORKLOAD, "variants": results, "summary": summary}
    print(f"# wrote {bc.write_json(args.json, payload)}", file=sys.stderr)
    if args.plot:
        groups = {
            "decode (batch 64)": {
                "step": summary["decode_step_ms"],
                "attention": summary["decode_attention_ms"],
                "KV write": summary["decode_kv_write_ms"],
            },
            "prefill (2048 tokens)": {
                "step": summary["prefill_step_ms"],
                "attention": summary["prefill_attention_ms"],
            },
        }
        title = bc.plot_title(
            f"tiny-llama device time; host {summary['host_pct_of_step_time']:.0f}% of a step", env
        )
        png = bc.plot_bars(
            pathlib.Path(args.json).with_suffix(".png"), title, groups, "ms (median)"
        )
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
