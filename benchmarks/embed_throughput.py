"""Embedding throughput: ``LLM.encode`` against the dense JAX forward a user would batch by hand.

    python benchmarks/embed_throughput.py [--model tiny-llama] [--model-config k=v,...]
        [--requests 256] [--min-len 32] [--max-len 256] [--pooling MEAN] [--batch 64]
        [--rounds 3] [--json PATH] [--plot]

Workload: seeded random prompts, lengths uniform in [min-len, max-len], one pooled vector
each (``pooling_type``, L2-normalised), fp32. jaxkv runs them as pooling requests (chunked
prefill in its token budget, ``max_num_batched_tokens`` 2048). The baseline is what one
writes without an engine: static batches of ``--batch`` prompts in arrival order, right-padded
to the batch's longest prompt rounded up to 64 (few compiles), one jitted dense forward
(``jaxkv.models.dense_hidden``) per batch, then the same pooling over each prompt's own tokens.
Both run the whole workload once untimed (every compile), then ``--rounds`` alternating timed
passes; the vectors must agree (max abs difference printed). Writes JSON, and with ``--plot``
a PNG next to it (prompts/s of both).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np
from _throughput_workloads import kv_pairs, load_model

from jaxkv import LLM, PoolingParams
from jaxkv.models.dense_reference import dense_hidden


def baseline_embed(fwd, prompts: list[list[int]], batch: int, kind: str) -> np.ndarray:
    """Static padded batches through the jitted dense forward; [n, hidden] normalised vectors."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        lens = np.array([len(p) for p in chunk])
        width = -(-int(lens.max()) // 64) * 64
        ids = np.zeros((batch, width), np.int32)  # a short last batch keeps the batch shape
        for r, p in enumerate(chunk):
            ids[r, : len(p)] = p
        h = np.asarray(fwd(jnp.asarray(ids)))[: len(chunk)]  # [b, width, hidden]
        mask = np.arange(width)[None, :] < lens[:, None]
        if kind == "MEAN":
            v = (h * mask[..., None]).sum(1) / lens[:, None]
        elif kind == "LAST":
            v = h[np.arange(len(chunk)), lens - 1]
        else:
            v = h[:, 0]
        out.append(v / np.linalg.norm(v, axis=-1, keepdims=True))
    return np.concatenate(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--model-config", default=None, help="random-init config overrides, k=v,...")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--pooling", default="MEAN", choices=["LAST", "MEAN", "CLS"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "embed_throughput.json"))
    p.add_argument(
        "--plot", action="store_true", help="also write a PNG next to the JSON (needs matplotlib)"
    )
    args = p.parse_args(argv)
    env = bc.environment()
    workload = dict(
        model=args.model,
        dtype="float32",
        requests=args.requests,
        prompt_len=f"U[{args.min_len}, {args.max_len}]",
        pooling=args.pooling,
        normalize=True,
        baseline=f"dense forward, static batches of {args.batch} padded to 64",
        max_num_batched_tokens=args.max_num_batched_tokens,
        rounds=args.rounds,
    )
    print(
        "\n".join(
            bc.header_lines(
                "Embedding throughput: jaxkv LLM.encode vs padded dense batches", env, workload
            )
        )
    )
    model, tok = load_model(
        args.model, args.seed, max_pos=args.max_len + 1, overrides=kv_pairs(args.model_config)
    )
    llm = LLM(
        model,
        tokenizer=tok,
        kv_cache_memory_bytes=512 << 20,
        max_num_seqs=min(64, args.max_num_batched_tokens),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(model.config.max_position_embeddings, max(512, args.max_len + 1)),
    )
    fwd = jax.jit(lambda ids: dense_hidden(model, ids))
    rng = np.random.default_rng(args.seed)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [
        rng.integers(1, vocab, int(rng.integers(args.min_len, args.max_len + 1))).tolist()
        for _ in range(args.requests)
    ]
    params = PoolingParams(pooling_type=args.pooling)
    tokens = sum(map(len, prompts))

    def run_jaxkv():
        llm.reset_prefix_cache()
        return np.stack([o.outputs.data for o in llm.encode(prompts, params, use_tqdm=False)])

    def run_baseline():
        return baseline_embed(fwd, prompts, args.batch, args.pooling)

    ours, theirs = run_jaxkv(), run_baseline()  # untimed: every compile
    diff = float(np.abs(ours - theirs).max())
    if diff > 1e-4:
        raise AssertionError(f"jaxkv and the dense baseline disagree by {diff}")
    times = {"jaxkv": [], "baseline": []}
    for _ in range(args.rounds):
        for name, fn in (("jaxkv", run_jaxkv), ("baseline", run_baseline)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name in ("jaxkv", "baseline"):
        best = min(times[name])
        rows.append(
            {
                "system": name,
                "best_s": best,
                "median_s": float(np.median(times[name])),
                "prompts_per_s": args.requests / best,
                "tokens_per_s": tokens / best,
            }
        )
    ratio = min(times["baseline"]) / min(times["jaxkv"])
    padded = sum(
        -(-max(map(len, prompts[i : i + args.batch])) // 64) * 64 * args.batch
        for i in range(0, len(prompts), args.batch)
    )
    print(
        bc.table(
            rows,
            ["system", "best_s", "median_s", "prompts_per_s", "tokens_per_s"],
            f"{args.requests} prompts, {tokens} tokens (baseline computes {padded} padded positions)",
        )
    )
    print(
        f"jaxkv / baseline (best of {args.rounds}): {ratio:.2f}x; max |difference| of the vectors {diff:.2e}"
    )
    print("CPU figures come from few noisy cores: compare the ratio within this run only.")
    payload = {
        "env": env,
        "workload": workload,
        "rows": rows,
        "times": times,
        "ratio": ratio,
        "max_abs_diff": diff,
        "tokens": tokens,
        "baseline_padded_positions": padded,
        "stats": llm.llm_engine.get_stats().to_dict(),
    }
    print(f"# wrote {bc.write_json(args.json, payload)}", file=sys.stderr)
    if args.plot:
        png = bc.plot_bars(
            pathlib.Path(args.json).with_suffix(".png"),
            bc.plot_title("embeddings", env),
            {
                f"{args.requests} prompts, {args.pooling}": {
                    r["system"]: r["prompts_per_s"] for r in rows
                }
            },
            "prompts / s (best pass)",
        )
        if png:
            print(f"# wrote {png}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
