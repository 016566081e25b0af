"""Host overhead of the scheduler: schedule() + update_from_output() per decode step.

Workload: N running requests (default 256) decoding one token a step, block size 16,
prefix caching on (every prompt shares a 64-token prefix), a pool large enough that no
request is preempted. The fake model output is built between the two timed calls (it is
the worker's work). Reports microseconds per request per step; writes JSON, and with
``--plot`` a PNG next to it (microseconds per step: schedule, update, total).

    python benchmarks/scheduler_overhead.py [--num-requests 256] [--steps 300]
        [--hash-algo sha256|builtin] [--output benchmarks/results/scheduler_overhead.json] [--plot]

The timed code is the plain-Python host core; this script loads no jax (nor ``bench_common``,
which imports it). matplotlib is imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from jaxkv.core import ModelRunnerOutput, Request, Scheduler
from jaxkv.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from jaxkv.sampling_params import SamplingParams


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _plot(path: str, title: str, metrics: dict) -> str | None:
    """One bar per metric to a PNG at ``path``; None (and a note) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(
            "# --plot: matplotlib is not installed (pip install 'jaxkv[bench]'); no PNG written",
            file=sys.stderr,
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.bar(list(metrics), list(metrics.values()))
    ax.set_ylabel("microseconds per step")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(num_requests: int, steps: int, block_size: int, prompt_len: int, hash_algo: str) -> dict:
    max_len = prompt_len + steps + 8
    num_blocks = num_requests * (-(-max_len // block_size)) + 1
    config = KVCacheConfig(
        num_blocks,
        (),
        (KVCacheGroupSpec(("layer0",), FullAttentionSpec(block_size, 8, 128, "bfloat16")),),
    )
    scheduler = Scheduler(
        config,
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        max_model_len=max_len + 8,
        enable_prefix_caching=True,
        hash_algo=hash_algo,
        eos_token_id=2,
    )
    shared = list(range(1000, 1064))
    for i in range(num_requests):
        prompt = shared + [(i * 7 + j) % 30000 + 3 for j in range(prompt_len - len(shared))]
        scheduler.add_request(
            Request(f"req-{i}", prompt, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        )

    requests = scheduler.requests

    def fake_output(out):
        # One token per request that completed its prompt; [] for a partial prefill chunk.
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for i, req_id in enumerate(req_ids):
            request = requests[req_id]
            sampled.append(
                [(i % 30000) + 3] if request.num_computed_tokens >= request.num_tokens else []
            )
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    # Prefill until every request is decoding.
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_output(out))

    sched_us, update_us = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        mro = fake_output(out)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, mro)
        t3 = time.perf_counter()
        assert len(out.num_scheduled_tokens) == num_requests, "a request was not scheduled"
        sched_us.append((t1 - t0) * 1e6)
        update_us.append((t3 - t2) * 1e6)
    assert scheduler.num_preemptions == 0
    total = [a + b for a, b in zip(sched_us, update_us)]
    return {
        "schedule_us_per_step_median": statistics.median(sched_us),
        "update_us_per_step_median": statistics.median(update_us),
        "total_us_per_step_median": statistics.median(total),
        "total_us_per_step_mean": statistics.fmean(total),
        "us_per_request_per_step": statistics.median(total) / num_requests,
        "prefix_cache_hit_rate": scheduler.make_stats().prefix_cache_hit_rate,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--hash-algo", default="sha256", choices=["sha256", "builtin"])
    parser.add_argument("--output", default="benchmarks/results/scheduler_overhead.json")
    parser.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    args = parser.parse_args(argv)

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    workload = {
        "num_requests": args.num_requests,
        "steps": args.steps,
        "block_size": args.block_size,
        "prompt_len": args.prompt_len,
        "shared_prefix_len": 64,
        "prefix_caching": True,
        "hash_algo": args.hash_algo,
        "phase": "decode (1 token per request per step)",
    }
    result = run(args.num_requests, args.steps, args.block_size, args.prompt_len, args.hash_algo)
    print("# jaxkv scheduler overhead (host only, no jax)")
    print(f"# hardware: {env['cpu']}, {env['cores']} usable cores (os reports {env['cpu_count']})")
    print(f"# versions: python {env['python']}; {env['platform']}")
    print(f"# date: {env['time']}")
    print("# workload: " + ", ".join(f"{k}={v}" for k, v in workload.items()))
    print(f"{'metric':<34}{'value':>12}")
    for key, value in result.items():
        print(f"{key:<34}{value:>12.3f}")
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"env": env, "workload": workload, "result": result}, f, indent=2)
        print(f"# wrote {args.output}")
    if args.plot:
        metrics = {
            "schedule\n(median)": result["schedule_us_per_step_median"],
            "update\n(median)": result["update_us_per_step_median"],
            "total\n(median)": result["total_us_per_step_median"],
            "total\n(mean)": result["total_us_per_step_mean"],
        }
        title = (
            f"scheduler host cost, {args.num_requests} decoding requests "
            f"({result['us_per_request_per_step']:.2f} us per request per step)\n"
            f"{env['cpu']}, {env['cores']} cores"
        )
        png = _plot(
            os.path.splitext(args.output or "scheduler_overhead.json")[0] + ".png", title, metrics
        )
        if png:
            print(f"# wrote {png}")


if __name__ == "__main__":
    main()
