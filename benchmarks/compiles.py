"""What a user waits for before and while the engine works: programs compiled and their time.

    python benchmarks/compiles.py [generate] [serving] [serve] [--json PATH]

Every XLA compile in the process is counted through jax's monitoring events
(``/jax/core/compile/backend_compile_duration``; a persistent-cache hit is counted apart, from
``/jax/compilation_cache/cache_hits``), not through the engine's own counters, so a compile the
engine does not know about is counted too. Each case runs in fresh processes, twice: the first
start (cold), then a second start with the same configuration (warm: what a restart costs).

* ``generate``: the README's first command, ``jaxkv generate`` (SmolLM2-135M-Instruct, four
  built-in prompts), in process with the counters around it.
* ``serving``: a serving-like offline workload on tiny-llama (``max_num_seqs=32``,
  ``max_model_len=1024``, default warm-up): six waves of 4-32 requests with prompts of 16-600
  tokens, each request one of six sampling settings (greedy; temperature + top_p; top_k;
  logprobs=5; presence + frequency penalties; min_tokens), seeded. Compiles are reported for
  the start-up and for each wave.
* ``serve``: ``jaxkv serve smollm2-135m-instruct`` on 127.0.0.1 until ``/health`` answers, then
  one completion: the time a user waits before the server is useful.

CPU figures on shared cores are noisy; compile counts are not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve().parent

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts XLA compiles (and persistent-cache hits) through jax.monitoring listeners."""

    def __init__(self):
        import jax.monitoring as monitoring

        self.compiles = 0  # backend compile calls, cache hits included
        self.seconds = 0.0
        self.cache_hits = 0

        def on_duration(event: str, duration: float, **_):
            if event == COMPILE_EVENT:
                self.compiles += 1
                self.seconds += duration

        def on_event(event: str, **_):
            if event == CACHE_HIT_EVENT:
                self.cache_hits += 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    def snapshot(self) -> dict:
        return {
            "compiles": self.compiles - self.cache_hits,
            "cache_hits": self.cache_hits,
            "compile_seconds": round(self.seconds, 2),
        }

    def since(self, before: dict) -> dict:
        now = self.snapshot()
        return {k: round(now[k] - before[k], 2) for k in now}


# ---- the cases, each in its own process ---------------------------------------------------------


def child_generate() -> dict:
    counter = CompileCounter()
    from jaxkv.entrypoints.cli import main

    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = main(["generate"])
    wall = time.perf_counter() - t0
    text = out.getvalue()
    tokens = sum(
        int(line.split("(")[1].split()[0])
        for line in text.splitlines()
        if line.strip().startswith("(") and "tokens, finish" in line
    )
    return {"rc": rc, "wall_s": round(wall, 2), "generated_tokens": tokens, **counter.snapshot()}


SETTINGS = ("greedy", "temperature+top_p", "top_k", "logprobs=5", "penalties", "min_tokens")


def _params(kind: str, max_tokens: int, seed: int):
    from jaxkv import SamplingParams

    common = dict(max_tokens=max_tokens, ignore_eos=True)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **common)
    if kind == "temperature+top_p":
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, **common)
    if kind == "top_k":
        return SamplingParams(temperature=1.0, top_k=20, seed=seed, **common)
    if kind == "logprobs=5":
        return SamplingParams(temperature=0.0, logprobs=5, **common)
    if kind == "penalties":
        return SamplingParams(
            temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=seed, **common
        )
    if kind == "min_tokens":
        return SamplingParams(
            temperature=0.0, min_tokens=max_tokens // 2, **dict(common, ignore_eos=False)
        )
    raise ValueError(kind)


WAVES = (4, 12, 32, 8, 24, 16)


def child_serving() -> dict:
    counter = CompileCounter()
    import numpy as np

    from jaxkv import LLM

    t0 = time.perf_counter()
    llm = LLM("tiny-llama", max_num_seqs=32, max_model_len=1024, kv_cache_memory_bytes=256 << 20)
    start = {"wall_s": round(time.perf_counter() - t0, 2), **counter.snapshot()}
    rng = np.random.default_rng(0)
    waves = []
    for w, size in enumerate(WAVES):
        lens = rng.integers(16, 601, size)
        prompts = [rng.integers(1, 200, n).tolist() for n in lens]
        params = [
            _params(SETTINGS[(w + i) % len(SETTINGS)], int(rng.integers(8, 48)), seed=w * 100 + i)
            for i in range(size)
        ]
        before = counter.snapshot()
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        waves.append(
            {
                "requests": size,
                "wall_s": round(time.perf_counter() - t1, 2),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                **counter.since(before),
            }
        )
    total = counter.snapshot()
    llm.shutdown()
    return {
        "start": start,
        "waves": waves,
        "total": total,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def child_serve() -> dict:
    import httpx

    sys.path.insert(0, str(HERE))
    import serve as sv

    args = argparse.Namespace(
        model="smollm2-135m-instruct",
        max_model_len=1024,
        kv_cache_memory="256MiB",
        max_num_seqs=16,
        warmup="on",
        enable_prefix_caching=True,
        max_num_batched_tokens=None,
    )
    log = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxkv-compiles-serve-{os.getpid()}.log"
    t0 = time.perf_counter()
    server = sv.Server(args, log, deadline=time.monotonic() + 900)
    healthy = time.perf_counter() - t0
    try:
        body = {
            "model": args.model,
            "prompt": "The capital of France is",
            "max_tokens": 16,
            "temperature": 0,
        }
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        first = time.perf_counter() - t0
    finally:
        server.stop()
    return {"healthy_s": round(healthy, 2), "first_completion_s": round(first, 2)}


CHILDREN = {"generate": child_generate, "serving": child_serving, "serve": child_serve}


def isolated_cache_dir(root: pathlib.Path) -> pathlib.Path:
    """A jaxkv cache directory whose compiled-program cache starts empty: everything else of
    the user's cache (converted checkpoints, the C++ kernels) is linked in, so the first start
    compiles everything but downloads and converts nothing."""
    from jaxkv.models.checkpoint.smollm2 import cache_dir

    root.mkdir(parents=True, exist_ok=True)
    user = cache_dir()
    if user.is_dir():
        for entry in user.iterdir():
            if entry.name != "xla" and not (root / entry.name).exists():
                (root / entry.name).symlink_to(entry)
    return root


def run_child(case: str, timeout: float, cache_root: pathlib.Path) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        JAXKV_CACHE_DIR=str(cache_root),
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--child", case],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{case} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "cases", nargs="*", default=list(CHILDREN), help="generate | serving | serve (default: all)"
    )
    p.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument(
        "--runs", type=int, default=2, help="starts per case: cold, then warm (default: 2)"
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(CHILDREN[args.child]()), flush=True)
        return 0
    import bench_common as bc

    env = bc.environment()
    print("\n".join(bc.header_lines("compiles: programs compiled and start-up time", env)))
    results = {"environment": env, "cases": {}}
    import tempfile

    for case in args.cases:
        runs = []
        cache_root = isolated_cache_dir(
            pathlib.Path(tempfile.mkdtemp(prefix=f"jaxkv-compiles-{case}-"))
        )
        for i in range(args.runs):
            res = run_child(case, args.timeout, cache_root)
            runs.append(res)
            print(f"{case} run {i + 1}: {json.dumps(res)}", flush=True)
        results["cases"][case] = runs
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
