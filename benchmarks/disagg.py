"""Prefill/decode disaggregation vs one colocated engine, in one run (vLLM's disaggregated
prefill benchmark, on jaxkv's device-to-device connector).

    python benchmarks/disagg.py [--model tiny-llama] [--quick] [--long-rate 2] [--json PATH]

Workload: ``--decoders`` requests with short prompts and long outputs start together (the
decoding background), and ``--long`` requests with long prompts and short outputs arrive as a
Poisson process (``--long-rate`` a second) while those decode. Two systems serve it, one after
the other, each warmed with the same workload first (untimed): (a) one ``jaxkv serve``
(colocated: long prefills share steps with the decoders); (b) a prefill ``jaxkv serve``
(``JaxTransferConnector``, ``kv_producer``) and a decode one (``kv_consumer``) behind
``jaxkv proxy``: D never computes a long prompt, it pulls P's pages. Per system and request
class: TTFT and TPOT mean / p50 / p99 in ms; for (b) also the KV bytes D loaded and the
connector's bytes per second (D's ``/metrics``: bytes / seconds from pull start to data), and
the tokens D loaded instead of computing.

Both instances of (b) run on this machine: on CPU they share its cores with each other (and
with the proxy), so (b) is not faster here; the figures show the mechanism and its costs
(CPU numbers on shared cores are noisy: compare within a run). On one GPU the two instances
share it too (``XLA_PYTHON_CLIENT_MEM_FRACTION`` is set to 0.4 for each unless given);
``--prefill-devices`` / ``--decode-devices`` put them on different GPUs
(``CUDA_VISIBLE_DEVICES``). Everything listens on 127.0.0.1 and is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import bench_common as bc
import numpy as np
import serve as sv

HOST = sv.HOST


def transfer_flags(role: str) -> tuple:
    return (
        "--kv-transfer-config",
        json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role}),
    )


def make_workload(args, vocab: int) -> tuple[list, list, list, dict]:
    """(prompts, output lengths, classes, description); long requests' arrival gaps are seeded."""
    rng = np.random.default_rng(args.seed)
    prompts, outs, kinds = [], [], []
    for _ in range(args.decoders):
        prompts.append(rng.integers(1, vocab, args.decode_prompt).tolist())
        outs.append(args.decode_tokens)
        kinds.append("decode")
    for _ in range(args.long):
        prompts.append(rng.integers(1, vocab, args.long_prompt).tolist())
        outs.append(args.long_tokens)
        kinds.append("long")
    desc = {
        "decoders": f"{args.decoders} x (prompt {args.decode_prompt}, {args.decode_tokens} out), all at t=0",
        "long": f"{args.long} x (prompt {args.long_prompt}, {args.long_tokens} out), Poisson "
        f"{args.long_rate}/s from t={args.long_start}s",
        "greedy": True,
        "ignore_eos": True,
    }
    return prompts, outs, kinds, desc


async def run_pass(
    url: str, model: str, prompts, outs, kinds, args, timeout_s: float
) -> list[dict]:
    import httpx

    rng = np.random.default_rng(args.seed + 1)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        tasks = []
        for p, n, k in zip(prompts, outs, kinds):
            if k == "decode":
                tasks.append(
                    asyncio.create_task(sv.one_request(http, url, model, p, n, time.perf_counter()))
                )
        await asyncio.sleep(args.long_start)
        for p, n, k in zip(prompts, outs, kinds):
            if k == "long":
                await asyncio.sleep(float(rng.exponential(1.0 / args.long_rate)))
                tasks.append(
                    asyncio.create_task(sv.one_request(http, url, model, p, n, time.perf_counter()))
                )
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    order = [k for k in kinds if k == "decode"] + [k for k in kinds if k == "long"]
    for r, k in zip(results, order):
        r["kind"] = k
    return results


def summarize(system: str, results: list[dict]) -> list[dict]:
    rows = []
    for kind in ("decode", "long"):
        sub = [r for r in results if r.get("kind") == kind]
        t0 = min((r["sent"] for r in sub if "sent" in r), default=0.0)
        row = sv.summarize_pass(sub, t0, float("nan"))
        rows.append(
            {
                "system": system,
                "class": kind,
                "completed": row["completed"],
                "errors": row["errors"],
                **{k: v for k, v in row.items() if k.startswith(("ttft", "tpot"))},
            }
        )
    return rows


def metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("jaxkv:kv_transfer") or line.startswith("jaxkv:prompt_tokens"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


@contextlib.contextmanager
def proxy(prefill: str, decode: str, deadline: float):
    import httpx

    port = sv._free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(sv.ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxkv.entrypoints.cli",
            "proxy",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--host",
            HOST,
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://{HOST}:{port}"
    try:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("jaxkv proxy did not come up")
            time.sleep(0.3)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def env_vars(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: v for k, v in kv.items() if v is not None})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_parser() -> argparse.ArgumentParser:
    from jaxkv.entrypoints.cli import parse_bytes

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--quick", action="store_true", help="a smaller workload (CPU, a few minutes)")
    p.add_argument("--decoders", type=int, default=32)
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--long", type=int, default=16)
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=16)
    p.add_argument("--long-rate", type=float, default=2.0, help="long requests a second (Poisson)")
    p.add_argument("--long-start", type=float, default=0.5, help="seconds after the decoders start")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=256 << 20)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--warmup", choices=("on", "off"), default="on")
    p.add_argument("--warm-passes", type=int, default=1)
    p.add_argument(
        "--prefill-devices", default=None, help="CUDA_VISIBLE_DEVICES of the prefill instance"
    )
    p.add_argument(
        "--decode-devices", default=None, help="CUDA_VISIBLE_DEVICES of the decode instance"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None)
    return p


QUICK = dict(
    decoders=8,
    decode_prompt=32,
    decode_tokens=64,
    long=4,
    long_prompt=384,
    long_tokens=8,
    max_model_len=1024,
    kv_cache_memory=64 << 20,
    max_num_seqs=16,
    max_num_batched_tokens=256,
)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.enable_prefix_caching = False  # the warm pass would make the timed prompts cache hits
    deadline = time.monotonic() + args.timeout
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    from jaxkv.models import load_model_config

    cfg, _ = load_model_config(args.model)
    prompts, outs, kinds, desc = make_workload(args, cfg.vocab_size)
    env = bc.environment()
    rows, transfer = [], {}

    def passes(url):
        for _ in range(args.warm_passes):
            asyncio.run(run_pass(url, args.model, prompts, outs, kinds, args, left()))
        return asyncio.run(run_pass(url, args.model, prompts, outs, kinds, args, left()))

    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-disagg-") as tmp:
        tmp = pathlib.Path(tmp)
        server = sv.Server(args, tmp / "colocated.log", deadline)
        try:
            rows += summarize("colocated", passes(server.url))
        finally:
            server.stop()
        frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")
        with env_vars(
            XLA_PYTHON_CLIENT_MEM_FRACTION=frac, CUDA_VISIBLE_DEVICES=args.prefill_devices
        ):
            p = sv.Server(args, tmp / "prefill.log", deadline, transfer_flags("kv_producer"))
        try:
            with env_vars(
                XLA_PYTHON_CLIENT_MEM_FRACTION=frac, CUDA_VISIBLE_DEVICES=args.decode_devices
            ):
                d = sv.Server(args, tmp / "decode.log", deadline, transfer_flags("kv_consumer"))
            try:
                with proxy(p.url, d.url, deadline) as url:
                    for _ in range(args.warm_passes):
                        asyncio.run(run_pass(url, args.model, prompts, outs, kinds, args, left()))
                    before = metrics(d.url)
                    results = asyncio.run(
                        run_pass(url, args.model, prompts, outs, kinds, args, left())
                    )
                    after = metrics(d.url)
                rows += summarize("P/D (proxy)", results)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                nbytes = delta.get("jaxkv:kv_transfer_bytes_total", 0.0)
                secs = delta.get("jaxkv:kv_transfer_seconds_total", 0.0)
                transfer = {
                    "kv_bytes_loaded": nbytes,
                    "pull_seconds_sum": secs,
                    "kv_mib_per_s": nbytes / secs / 2**20 if secs else None,
                    "tokens_loaded": delta.get("jaxkv:kv_transfer_external_tokens_total", 0.0),
                    "failed_loads": delta.get("jaxkv:kv_transfer_failed_loads_total", 0.0),
                    "decode_prompt_tokens": delta.get("jaxkv:prompt_tokens_total", 0.0),
                }
            finally:
                d.stop()
        finally:
            p.stop()
    by = {(r["system"], r["class"]): r for r in rows}
    ratios = {}
    for kind in ("decode", "long"):
        a, b = by.get(("colocated", kind)), by.get(("P/D (proxy)", kind))
        if a and b:
            for m in ("ttft_ms_p50", "tpot_ms_p50"):
                if a.get(m) and b.get(m):
                    ratios[f"{kind} {m} P/D / colocated"] = b[m] / a[m]
    payload = {
        "benchmark": "disagg",
        "environment": env,
        "workload": desc,
        "model": args.model,
        "engine": sv.engine_kwargs(args),
        "rows": rows,
        "transfer": transfer,
        "ratios": ratios,
    }
    print(
        "\n".join(
            bc.header_lines("P/D disaggregation (JaxTransferConnector) vs colocated", env, desc)
        )
    )
    print(
        bc.table(
            rows,
            [
                "system",
                "class",
                "completed",
                "ttft_ms_mean",
                "ttft_ms_p50",
                "ttft_ms_p99",
                "tpot_ms_mean",
                "tpot_ms_p50",
                "tpot_ms_p99",
            ],
        )
    )
    print("KV transfer (D, timed pass):", json.dumps(transfer))
    print("ratios:", json.dumps({k: round(v, 3) for k, v in ratios.items()}))
    if args.json:
        bc.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
