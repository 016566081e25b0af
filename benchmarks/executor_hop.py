"""The process hop: decode step time through each executor, and pickle vs msgspec.

Configurations, each replaying the same recorded ``SchedulerOutput`` s (one request, then 64,
decoding ``--decode-steps`` tokens each) and timing every decode step (``execute_model`` as
the engine core calls it: host inputs, the jitted step, the results back):

  (a) in-process: ``ModelRunner`` on one device (what ``UniProcExecutor`` calls)
  (b) in-process TP 2: the same over two CPU host devices of this process
  (c) ``MultiprocExecutor`` TP 2: two worker processes, one device each (gloo collectives)
  (d) ``MultiprocExecutor`` with one worker process (the hop alone, no TP)

The hop is (d) - (a). Also: a no-op ``collective_rpc`` round trip for (c) and (d), and
serialising a batch-64 decode ``SchedulerOutput`` and its ``ModelRunnerOutput`` with pickle
(protocol 5) and msgspec (msgpack).

    python benchmarks/executor_hop.py [--model tiny-llama] [--decode-steps 24]
        [--json benchmarks/results/executor_hop.json]
"""

from __future__ import annotations

import os

# (b) needs two host devices in this process; set before jax starts (worker processes drop it).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pickle
import statistics
import sys
import time

import numpy as np
from bench_common import environment, header_lines, table, write_json


def record(args):
    """(pickled SchedulerOutputs, sampled tokens) of an in-process engine: a batch of one
    request, then one of 64, each ``decode_steps`` tokens after a 32-token prompt."""
    from jaxkv.engine import LLMEngine
    from jaxkv.sampling_params import SamplingParams

    eng = LLMEngine.from_config(
        args.model,
        num_gpu_blocks_override=args.num_blocks,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=args.max_model_len,
        warmup=False,
    )
    steps, execute = [], eng.runner.execute_model

    def recording(so):
        out = execute(so)
        steps.append((pickle.dumps(so, protocol=5), out.sampled_token_ids))
        return out

    eng.runner.execute_model = recording
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
    for batch in (1, 64):
        for i in range(batch):
            eng.add_request(f"b{batch}-{i}", rng.integers(3, 30000, size=32).tolist(), params)
        while eng.has_unfinished_requests():
            eng.step()
    return steps, eng.kv_cache_config


def is_decode(so) -> bool:
    return (
        not so.scheduled_new_reqs
        and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) > 0
    )


def replay_all(targets: dict, steps, hops: dict) -> dict[str, dict[int, list[float]]]:
    """Seconds per decode step, per target and batch size (each batch's first 3 decode steps,
    which may compile, dropped); checks every step's tokens against the recording. ``hops``
    gets, per multi-process target and batch, execute_model's time minus the driver worker's
    own time on the step (dispatch to collected): the hop itself."""
    times: dict[str, dict[int, list[float]]] = {name: {} for name in targets}
    for blob, tokens in steps:
        for name, target in targets.items():
            so = pickle.loads(blob)
            t0 = time.perf_counter()
            out = target.execute_model(so)
            dt = time.perf_counter() - t0
            if out.sampled_token_ids != tokens:
                raise AssertionError(
                    f"{name}: tokens differ from the in-process engine's: "
                    f"{out.sampled_token_ids[:4]} vs {tokens[:4]}"
                )
            if is_decode(so):
                b = len(so.num_scheduled_tokens)
                times[name].setdefault(b, []).append(dt)
                timing = getattr(target, "last_step_timing", None)
                if timing is not None:  # (arrived, began, ended, pickled, received here)
                    arrived, began, ended, pickled, received = timing
                    hops.setdefault(name, {}).setdefault(b, []).append(
                        (
                            dt - (ended - began),
                            arrived - target.last_send_time,
                            began - arrived,
                            pickled - ended,
                            received - pickled,
                            t0 + dt - received,
                        )
                    )
    for by in hops.values():
        for b in by:
            by[b] = by[b][3:]
    return {name: {b: t[3:] for b, t in by.items()} for name, by in times.items()}


def in_process(args, kv_config, tp: int):
    import jax

    from jaxkv.models.registry import load_model
    from jaxkv.models.sharding import make_tp_mesh
    from jaxkv.worker.model_runner import ModelRunner

    model, _, _ = load_model(args.model, seed=0)
    if tp > 1:
        from jaxkv.kv_cache import get_kv_cache_config, kv_cache_specs_from_layers
        from jaxkv.worker.worker import per_device_layers

        specs = kv_cache_specs_from_layers(
            per_device_layers(model, model.config, tp), block_size=16, cache_dtype="float32"
        )
        kv_config = get_kv_cache_config(
            specs,
            1 << 40,
            max_model_len=args.max_model_len,
            num_gpu_blocks_override=args.num_blocks,
        )
    assert jax.device_count() >= tp
    return ModelRunner(
        model,
        kv_config,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=args.max_model_len,
        mesh=make_tp_mesh(tp) if tp > 1 else None,
    )


def multiproc(args, tp: int):
    from jaxkv.engine_config import resolve_engine_config
    from jaxkv.executor.multiproc import MultiprocExecutor
    from jaxkv.kv_cache import get_kv_cache_configs

    _, _, _, config = resolve_engine_config(
        args.model,
        distributed_executor_backend="mp",
        tensor_parallel_size=tp,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=args.max_model_len,
        warmup=False,
    )
    ex = MultiprocExecutor(config)
    configs = get_kv_cache_configs(
        ex.get_kv_cache_specs(),
        [1 << 40] * tp,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_blocks,
    )
    ex.initialize_from_config(configs)
    return ex


def rpc_round_trip(ex, n: int = 200) -> float:
    for _ in range(10):
        ex.collective_rpc("runner_stats")
    t0 = time.perf_counter()
    for _ in range(n):
        ex.collective_rpc("runner_stats")
    return (time.perf_counter() - t0) / n


def serialisation(steps) -> list[dict]:
    """Encode + decode microseconds and bytes of a batch-64 decode SchedulerOutput and of a
    batch-64 ModelRunnerOutput, with pickle and msgspec."""
    import msgspec

    from jaxkv.core import ModelRunnerOutput, SchedulerOutput

    so = next(
        pickle.loads(b)
        for b, _ in steps
        if is_decode(pickle.loads(b)) and len(pickle.loads(b).num_scheduled_tokens) == 64
    )
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
    )
    prefill = next(
        pickle.loads(b) for b, _ in steps if len(pickle.loads(b).scheduled_new_reqs) == 64
    )
    rows = []
    for name, obj, typ in (
        ("SchedulerOutput (64 decodes)", so, SchedulerOutput),
        ("SchedulerOutput (64 new requests)", prefill, SchedulerOutput),
        ("ModelRunnerOutput (64 rows)", mro, ModelRunnerOutput),
    ):

        def timed(fn, n=2000):
            fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n * 1e6

        blob = pickle.dumps(obj, protocol=5)
        rows.append(
            dict(
                object=name,
                codec="pickle 5",
                bytes=len(blob),
                encode_us=timed(lambda: pickle.dumps(obj, protocol=5)),
                decode_us=timed(lambda: pickle.loads(blob)),
                note="any object",
            )
        )
        enc = msgspec.msgpack.Encoder()
        try:
            mblob = enc.encode(obj)
            enc_us = timed(lambda: enc.encode(obj))
        except Exception as exc:
            rows.append(
                dict(object=name, codec="msgspec msgpack", note=f"encode fails: {exc}"[:90])
            )
            continue
        dec = msgspec.msgpack.Decoder(typ)
        try:
            back = dec.decode(mblob)
            note = "typed decode" + ("" if back == obj else " (not equal!)")
            dec_us = timed(lambda: dec.decode(mblob))
        except Exception as exc:
            note = f"typed decode fails ({type(exc).__name__}); untyped shown"
            untyped = msgspec.msgpack.Decoder()
            dec_us = timed(lambda: untyped.decode(mblob))
        rows.append(
            dict(
                object=name,
                codec="msgspec msgpack",
                bytes=len(mblob),
                encode_us=enc_us,
                decode_us=dec_us,
                note=note,
            )
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=400)
    p.add_argument(
        "--configs", default="a,b,c,d", help="which of a,b,c,d to run (a and d for the hop)"
    )
    p.add_argument("--json", default="benchmarks/results/executor_hop.json")
    args = p.parse_args(argv)

    env = environment()
    workload = dict(
        model=args.model,
        prompt=32,
        decode_steps=args.decode_steps,
        batches="1, 64",
        block_size=16,
        dtype="float32",
    )
    print(
        "\n".join(header_lines("executor hop: decode step time per executor", env, workload)),
        flush=True,
    )
    steps, kv_config = record(args)
    ser = serialisation(steps)
    print(
        table(
            ser,
            ["object", "codec", "bytes", "encode_us", "decode_us", "note"],
            "serialisation (microseconds per call)",
        ),
        flush=True,
    )

    # All four alive at once, each step run on each in turn: they share the (noisy) machine's
    # load step by step, so their per-step differences are paired.
    targets, rpc, hops = {}, {}, {}
    try:
        makers = {
            "a": ("a in-process", lambda: in_process(args, kv_config, 1)),
            "b": ("b in-process TP2 (2 host devices)", lambda: in_process(args, kv_config, 2)),
            "c": ("c multiproc TP2 (2 processes)", lambda: multiproc(args, 2)),
            "d": ("d multiproc 1 worker", lambda: multiproc(args, 1)),
        }
        for key in args.configs.split(","):
            name, make = makers[key]
            targets[name] = make()
        results = replay_all(targets, steps, hops)
        for name, t in targets.items():
            if hasattr(t, "collective_rpc"):
                rpc[name] = rpc_round_trip(t)
    finally:
        for t in targets.values():
            if hasattr(t, "shutdown"):
                t.shutdown()

    rows = []
    for name, by_batch in results.items():
        for b in sorted(by_batch):
            t = by_batch[b]
            rows.append(
                dict(
                    config=name,
                    batch=b,
                    median_ms=statistics.median(t) * 1e3,
                    p10_ms=float(np.percentile(t, 10)) * 1e3,
                    p90_ms=float(np.percentile(t, 90)) * 1e3,
                    steps=len(t),
                )
            )
    print(
        table(
            rows,
            ["config", "batch", "median_ms", "p10_ms", "p90_ms", "steps"],
            "decode step, ms (execute_model as the engine core calls it)",
        )
    )
    a = {r["batch"]: r["median_ms"] for r in rows if r["config"].startswith("a ")}
    d = {r["batch"]: r["median_ms"] for r in rows if r["config"].startswith("d ")}
    hop = {b: d[b] - a[b] for b in a if b in d}
    paired = {
        b: statistics.median(
            np.subtract(results["d multiproc 1 worker"][b], results["a in-process"][b])
        )
        * 1e3
        for b in results.get("a in-process", {})
        if "d multiproc 1 worker" in results
    }
    for b, h in hop.items() if paired else ():
        print(
            f"# hop (d - a) at batch {b}: {h:+.3f} ms per step (median of medians); "
            f"median of paired per-step differences {paired[b]:+.3f} ms"
        )
    parts = (
        "hop_total",
        "send_to_arrival",
        "unpickle_to_dispatch",
        "reply_pickle",
        "reply_to_receipt",
        "receipt_to_return",
    )
    hop_direct = []
    for name, by in hops.items():
        for b, h in by.items():
            h = np.asarray(h) * 1e6  # [steps, parts] microseconds
            hop_direct.append(
                dict(
                    config=name,
                    batch=b,
                    **{f"{p}_us": float(np.median(h[:, i])) for i, p in enumerate(parts)},
                    hop_total_p90_us=float(np.percentile(h[:, 0], 90)),
                )
            )
    print(
        table(
            hop_direct,
            ["config", "batch"] + [f"{p}_us" for p in parts] + ["hop_total_p90_us"],
            "the hop measured directly: execute_model minus the driver's own step time, and its "
            "parts (medians, microseconds)",
        )
    )
    for name, s in rpc.items():
        print(f"# no-op collective_rpc round trip, {name}: {s * 1e6:.0f} us")
    path = write_json(
        args.json,
        dict(
            environment=env,
            workload=workload,
            serialisation=ser,
            steps=rows,
            hop_ms=hop,
            hop_paired_ms=paired,
            hop_direct=hop_direct,
            rpc_round_trip_s=rpc,
        ),
    )
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
