"""Decode with float, int8, fp8 and q4 weights: one checkpoint, one process, alternating rounds.

    python benchmarks/quantized_decode.py [--model smollm2-135m-instruct] [--batch 1,8]
        [--max-tokens 128] [--prompt-len 32] [--rounds 4] [--no-matmuls] [--json PATH]

First (unless ``--no-matmuls``) single matmuls ``x [M, K] @ w [K, N]``: float32 weights
(XLA), int8 / fp8 / q4 weights through XLA (int8 / fp8: convert, dot, scale; q4: dequantize,
dot) and through the path the engine takes (``quantized_matmul``: the C++ kernels on the CPU),
best of 5 x 50 calls each.

For each batch size, one engine per weight mode (``quantization`` None, "int8", "fp8", "q4") on the
same checkpoint, warmed up, then timed rounds that alternate the modes (float, int8, fp8, then
the reverse) so that drift of a shared machine hits them alike. A round is ``batch`` greedy
requests of ``prompt-len`` random tokens decoding ``max-tokens`` tokens each (EOS ignored).
Prints per mode the best and median decode rate (tokens/s over the whole round), the weights
held on the device (``device_weight_bytes``), the bytes a decode step streams (those weights
less the embedding table, of which a step reads a few rows; a tied float head reads it whole)
and the rate at which they stream (streamed bytes x steps / s), the ratio to the float engine,
and how many generated tokens agree with the float engine's (quantization changes the
numbers, so some divergence is expected). On the CPU the int8 / fp8 linears of a decode step
run the C++ kernels (``jaxkv.models.quant.quantized_matmul``). SmolLM2 with "q4" keeps its
GGUF's Q4_1 blocks as stored (and its Q8_0 embedding as the int8 head); with "int8" its Q4_1
tensors are re-quantized to int8 blocks of 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import bench_common as bc
import numpy as np

MODES = (None, "int8", "fp8", "q4")


def _name(mode) -> str:
    return "float" if mode is None else mode


def _round(llm, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


MATMUL_SHAPES = ((576, 1536), (1536, 576), (4096, 4096))  # SmolLM2's up / down, a Llama-8B one


def _best_time(fn, *args, calls: int = 50) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def matmuls(rows=(1, 8)) -> list[dict]:
    """Per shape, mode and row count: microseconds of float32, XLA-quantized and engine paths."""
    import jax
    import jax.numpy as jnp

    from jaxkv.models.quant import dequantize_q4, quantize, quantize_q4, quantized_matmul

    rng = np.random.default_rng(0)
    out = []
    for n_in, n_out in MATMUL_SHAPES:
        w = rng.standard_normal((n_in, n_out)).astype(np.float32)
        for mode in ("int8", "fp8", "q4"):
            if mode == "q4":
                parts = tuple(jnp.asarray(a) for a in quantize_q4(w))

                def xla_form(x, p, s, o):
                    return x @ dequantize_q4(p, s, o)

                def engine_form(x, p, s, o):
                    return quantized_matmul(x, p, s, jnp.float32, offset=o)
            else:
                parts = tuple(jnp.asarray(a) for a in quantize(w, mode))

                def xla_form(x, q, s):
                    return (x @ q.astype(jnp.float32)) * s

                def engine_form(x, q, s):
                    return quantized_matmul(x, q, s, jnp.float32)

            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, n_in)).astype(np.float32))
                f32 = _best_time(jax.jit(lambda x, w: x @ w), x, jnp.asarray(w))
                xla = _best_time(jax.jit(xla_form), x, *parts)
                engine = _best_time(jax.jit(engine_form), x, *parts)
                out.append(
                    dict(
                        shape=f"{m}x{n_in} @ {n_in}x{n_out}",
                        weights=mode,
                        f32_us=f32 * 1e6,
                        xla_quant_us=xla * 1e6,
                        engine_us=engine * 1e6,
                        engine_GB_s=n_in * n_out / engine / 1e9,
                        vs_f32=f32 / engine,
                        vs_xla_quant=xla / engine,
                    )
                )
    return out


def _unread_embedding_bytes(model) -> int:
    """Bytes of the embedding table a decode step does not stream: all of it, unless it is
    also the (float, tied) LM head."""
    table = model.model.embed_tokens.embedding[...]
    return 0 if getattr(model, "lm_head", None) is None else table.size * table.dtype.itemsize


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-matmuls", action="store_true", help="skip the single-matmul timings")
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "quantized_decode_cpu.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    batches = [int(b) for b in args.batch.split(",")]

    from jaxkv import LLM, SamplingParams
    from jaxkv.worker.memory_profile import device_weight_bytes

    env = bc.environment()
    workload = dict(
        model=args.model,
        batch=args.batch,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        greedy=True,
        rounds=args.rounds,
    )
    print("\n".join(bc.header_lines("decode with float / int8 / fp8 / q4 weights", env, workload)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    if not args.no_matmuls:
        rows = matmuls()
        cols = ["shape", "weights", "f32_us", "xla_quant_us", "engine_us", "engine_GB_s"]
        print(bc.table(rows, [*cols, "vs_f32", "vs_xla_quant"], title="single matmuls"))
        results["matmuls"] = rows
    for batch in batches:
        llms, weight_bytes, streamed = {}, {}, {}
        for mode in MODES:
            llm = LLM(
                args.model,
                quantization=mode,
                max_num_seqs=max(batch, 1),
                max_model_len=args.prompt_len + args.max_tokens + 16,
                kv_cache_memory_bytes=64 << 20,
                seed=args.seed,
            )
            worker = llm.llm_engine.engine_core.model_executor.driver_worker.worker
            weight_bytes[mode] = device_weight_bytes(worker.model)
            streamed[mode] = weight_bytes[mode] - _unread_embedding_bytes(worker.model)
            llms[mode] = llm
        vocab = llms[None].llm_engine.model_config.vocab_size
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(batch)]
        for mode in MODES:  # warm-up: every program of the round compiled
            _round(llms[mode], prompts, params)
        times = {m: [] for m in MODES}
        tokens = {}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                elapsed, toks = _round(llms[mode], prompts, params)
                times[mode].append(elapsed)
                tokens.setdefault(mode, toks)
            print(
                f"batch {batch} round {r}: "
                + ", ".join(f"{_name(m)} {times[m][-1]:.3f} s" for m in MODES),
                flush=True,
            )
        rows = []
        for mode in MODES:
            best = min(times[mode])
            steps_per_s = args.max_tokens / best
            same = sum(a == b for x, y in zip(tokens[mode], tokens[None]) for a, b in zip(x, y)) / (
                batch * args.max_tokens
            )
            rows.append(
                dict(
                    weights=_name(mode),
                    weight_MiB=weight_bytes[mode] / 2**20,
                    tok_s_best=batch * args.max_tokens / best,
                    tok_s_median=batch * args.max_tokens / statistics.median(times[mode]),
                    streamed_MiB=streamed[mode] / 2**20,
                    weight_GB_s=streamed[mode] * steps_per_s / 1e9,
                    speed_vs_float=min(times[None]) / best,
                    tokens_as_float=same,
                )
            )
        print(
            bc.table(
                rows,
                [
                    "weights",
                    "weight_MiB",
                    "streamed_MiB",
                    "tok_s_best",
                    "tok_s_median",
                    "weight_GB_s",
                    "speed_vs_float",
                    "tokens_as_float",
                ],
                title=f"batch {batch}",
            )
        )
        results[str(batch)] = {"times_s": {_name(m): times[m] for m in MODES}, "rows": rows}
        for llm in llms.values():
            llm.shutdown()
    payload = {"env": env, "workload": workload, "results": results}
    print(f"# wrote {bc.write_json(args.json, payload)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
