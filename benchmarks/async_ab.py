"""Async scheduling A/B: the same engine with ``async_scheduling`` off and on, in ONE process.

    python benchmarks/async_ab.py [--model tiny-llama] [--model-config K=V,...] [--requests 64]
        [--prompt 32:256] [--max-tokens 64] [--rounds 6] [--json PATH] [--plot]

Both engines get the same weights, the same greedy requests (the ``fixed`` workload of
``throughput.py`` by default) and are warmed up with one untimed pass; then timed passes
alternate (sync, async, async, sync, ...) so that drift of shared machines hits both alike.
Prints the wall time of each pass, min and median per mode, sync / async (> 1: async is
faster) and whether the greedy tokens are equal; writes JSON, and with ``--plot`` a PNG next
to it (seconds per pass, sync vs async: each round, min, median). Async scheduling can only
gain where the host and the device do not share the cores the step runs on: on a CPU-only
machine the host's Python competes with XLA's threads for the same cores.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import bench_common as bc
import engine_harness as eh
import numpy as np


def _pass(engine, prompts, max_tokens, tag) -> tuple[float, list[list[int]]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, eh.greedy(max_tokens))
    done = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.rsplit("-", 1)[1])] = out.outputs[0].token_ids
    elapsed = time.perf_counter() - t0
    if not engine.scheduler.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache between passes")
    return elapsed, [done[i] for i in range(len(prompts))]


def main(argv=None) -> dict:
    from jaxkv.entrypoints.cli import parse_bytes

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny-llama")
    p.add_argument(
        "--model-config", default=None, metavar="K=V,...", help="config overrides (random init)"
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", default="32:256", help="prompt lengths U[lo, hi]")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("512MiB"))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "async_ab.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    lo, hi = (int(x) for x in args.prompt.split(":"))
    from _throughput_workloads import kv_pairs, load_model

    model, tok = load_model(args.model, args.seed, overrides=kv_pairs(args.model_config))
    rng = np.random.default_rng(args.seed)
    prompts = [
        eh.seeded_tokens(rng, int(rng.integers(lo, hi + 1)), model.config.vocab_size)
        for _ in range(args.requests)
    ]
    env = bc.environment()
    workload = dict(
        model=args.model,
        requests=args.requests,
        prompt=f"U[{lo},{hi}]",
        max_tokens=args.max_tokens,
        greedy=True,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    print("\n".join(bc.header_lines("async scheduling A/B (jaxkv, one process)", env, workload)))
    engines = {}
    for mode in (False, True):
        engine, _ = eh.build_engine(
            model,
            tok,
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=args.kv_cache_memory,
            seed=args.seed,
            async_scheduling=mode,
        )
        engine.runner.warmup(progress=False)
        _pass(engine, prompts, args.max_tokens, f"warm{mode}")
        engines[mode] = engine
    times = {False: [], True: []}
    tokens = {}
    for r in range(args.rounds):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            elapsed, toks = _pass(engines[mode], prompts, args.max_tokens, f"{r}{mode}")
            times[mode].append(elapsed)
            tokens.setdefault(mode, toks)
        print(
            f"round {r}: sync {times[False][-1]:.3f} s, async {times[True][-1]:.3f} s, "
            f"sync/async {times[False][-1] / times[True][-1]:.3f}",
            flush=True,
        )
    equal = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    paired = [a / b for a, b in zip(times[False], times[True])]
    summary = {
        "sync_min_s": min(times[False]),
        "async_min_s": min(times[True]),
        "sync_median_s": statistics.median(times[False]),
        "async_median_s": statistics.median(times[True]),
        "sync_over_async_min": min(times[False]) / min(times[True]),
        "sync_over_async_paired_median": statistics.median(paired),
        "greedy_tokens_equal": f"{equal}/{len(prompts)}",
    }
    print(
        f"sync min {summary['sync_min_s']:.3f} s / async min {summary['async_min_s']:.3f} s = "
        f"{summary['sync_over_async_min']:.3f}; paired median {summary['sync_over_async_paired_median']:.3f}; "
        f"greedy tokens equal {summary['greedy_tokens_equal']}"
    )
    payload = {
        "env": env,
        "workload": workload,
        "rounds": args.rounds,
        "times_s": {"sync": times[False], "async": times[True]},
        "summary": summary,
    }
    print(f"# wrote {bc.write_json(args.json, payload)}", file=sys.stderr)
    if args.plot:
        groups = {
            f"round {r}": {"sync": a, "async": b}
            for r, (a, b) in enumerate(zip(times[False], times[True]))
        }
        groups.update(
            min={"sync": summary["sync_min_s"], "async": summary["async_min_s"]},
            median={"sync": summary["sync_median_s"], "async": summary["async_median_s"]},
        )
        title = bc.plot_title(f"async scheduling A/B, {args.model}, {args.requests} requests", env)
        png = bc.plot_bars(
            pathlib.Path(args.json).with_suffix(".png"), title, groups, "seconds per pass"
        )
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
