"""A randomised workload that touches every program the engine has: every sampling option,
n > 1, stop strings, prompt logprobs, pooling requests, chunked prefill, prefix hits,
preemption and aborts, arriving in waves while the engine runs.

It drives ``LLMEngine`` through its public methods only (``add_request``, ``abort_request``,
``step``), so the same workload runs on any version of the engine: ``golden_mixed_workload.json``
next to this file holds what the engine before the compiled-program rework returned for it
(``python -m tests.engine.mixed_workload > tests/engine/golden_mixed_workload.json``, run in a
checkout of that version).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

#: The engine's settings: a cache small enough that long requests preempt, chunked prefill.
ENGINE = dict(
    max_num_seqs=6,
    max_num_batched_tokens=48,
    max_model_len=256,
    block_size=16,
    kv_cache_memory_bytes=None,
    num_gpu_blocks_override=28,
)


class CharTokenizer:
    """Token id i decodes to chr(ord('a') + i % 26): enough for stop strings."""

    eos_token_id = None
    bos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) - ord("a") for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _sampling(kind: str, rng: np.random.Generator, max_tokens: int) -> SamplingParams:
    seed = int(rng.integers(1 << 30))
    common = dict(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    options = {
        "greedy": dict(temperature=0.0),
        "top_p": dict(temperature=0.8, top_p=0.9, seed=seed),
        "top_k": dict(temperature=1.0, top_k=20, seed=seed),
        "min_p": dict(temperature=1.0, min_p=0.1, seed=seed),
        "logprobs": dict(temperature=0.0, logprobs=3),
        "prompt_logprobs": dict(temperature=0.0, prompt_logprobs=2),
        "penalties": dict(
            temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
        ),
        "sampled_penalties": dict(temperature=0.7, repetition_penalty=1.3, seed=seed),
        "logit_bias": dict(
            temperature=0.0, logit_bias={int(t): 5.0 for t in rng.integers(0, 512, 3)}
        ),
        "allowed": dict(
            temperature=0.0, allowed_token_ids=sorted({int(t) for t in rng.integers(0, 512, 40)})
        ),
        "bad_words": dict(
            temperature=0.0,
            bad_words_token_ids=[
                [int(rng.integers(512))],
                [int(t) for t in rng.integers(0, 512, 2)],
            ],
        ),
        "min_tokens": dict(
            temperature=0.0, min_tokens=max_tokens // 2, stop_token_ids=[int(rng.integers(512))]
        ),
        "n2": dict(temperature=0.9, n=2, seed=seed),
        "stop": dict(temperature=0.0, stop=["q", "zz"]),
    }
    kw = dict(options[kind])
    if kind == "min_tokens":
        common["ignore_eos"] = False
    return SamplingParams(**{**common, **kw})


KINDS = (
    "greedy",
    "top_p",
    "top_k",
    "min_p",
    "logprobs",
    "prompt_logprobs",
    "penalties",
    "sampled_penalties",
    "logit_bias",
    "allowed",
    "bad_words",
    "min_tokens",
    "n2",
    "stop",
    "pool",
)


@dataclasses.dataclass
class Arrival:
    req_id: str
    prompt: list[int]
    params: object
    at_step: int
    abort_at: int | None = None


def requests(seed: int = 0, waves: int = 5) -> list[Arrival]:
    """Waves of requests: every kind at least once, shared prefixes, prompts up to 150 tokens
    (several chunks), a few aborted while they run."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 512, 40).tolist()
    out, step, i = [], 0, 0
    for _wave in range(waves):
        for _ in range(int(rng.integers(4, 9))):
            kind = KINDS[i % len(KINDS)]
            n = int(rng.integers(3, 150))
            prompt = rng.integers(1, 512, n).tolist()
            if rng.random() < 0.3:
                prompt = shared + prompt[:20]  # prefix-cache hits
            params = (
                PoolingParams()
                if kind == "pool"
                else _sampling(kind, rng, int(rng.integers(4, 24)))
            )
            abort = step + int(rng.integers(1, 6)) if rng.random() < 0.1 else None
            out.append(Arrival(f"{kind}-{i}", prompt, params, step, abort))
            i += 1
        step += int(rng.integers(2, 10))
    return out


def run(engine, arrivals: list[Arrival], max_steps: int = 2000) -> dict[str, object]:
    """Runs the arrivals; returns ``{request id: result}`` of the requests that were not aborted:
    a list of token lists (one per completion), or the pooled vector as a list for pooling ones."""
    pending = sorted(arrivals, key=lambda a: a.at_step)
    aborts: dict[int, list[str]] = {}
    results: dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].at_step <= step:
            a = pending.pop(0)
            engine.add_request(a.req_id, a.prompt, a.params)
            if a.abort_at is not None:
                aborts.setdefault(a.abort_at, []).append(a.req_id)
        for req_id in aborts.pop(step, ()):
            engine.abort_request(req_id)
            results[req_id] = None
        for out in engine.step():
            if not out.finished:
                continue
            if hasattr(out, "outputs") and isinstance(out.outputs, list):
                results.setdefault(
                    out.request_id,
                    [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)],
                )
            else:
                results.setdefault(
                    out.request_id, np.asarray(out.outputs.data, np.float32).round(4).tolist()
                )
        step += 1
        if step > max_steps:
            raise RuntimeError("the workload did not finish")
    return {k: v for k, v in results.items() if v is not None}


def main() -> int:
    from tests.engine.helpers import make_llm, small_model

    llm = make_llm(small_model("tiny-llama"), tokenizer=CharTokenizer(), **ENGINE)
    print(json.dumps(run(llm.llm_engine, requests()), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
