"""One engine with a KV connector, run as a process of its own by the KV-transfer tests.

``python -m tests.distributed.kv_engine SPEC.json`` reads ``{"engine": LLM kwargs, "prompts":
[[ids]], "params": [kv_transfer_params or null] (optional), "max_tokens": n, "drain_s": s,
"warm": [[ids]] (optional: generated first, without parameters), "out": path}``, generates greedily
and writes to ``out``:
per request its tokens, ``num_cached_tokens`` and ``kv_transfer_params``, then the
scheduler's counters. A producer keeps stepping after its outputs until every send is
reported (or ``drain_s`` passes), then writes its free-block count again.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(path: str) -> int:
    from jaxkv import LLM, SamplingParams

    spec = json.load(open(path))
    llm = LLM(spec.get("model", "tiny-llama"), **spec["engine"])
    engine = llm.llm_engine
    prompts = spec["prompts"]
    params = spec.get("params") or [None] * len(prompts)
    sps = [
        SamplingParams(
            temperature=0,
            max_tokens=spec.get("max_tokens", 8),
            ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p is not None else None,
        )
        for p in params
    ]
    warm = spec.get("warm")
    if warm:  # a first batch without transfer parameters (fills the prefix cache)
        llm.generate(
            [{"prompt_token_ids": p} for p in warm],
            SamplingParams(temperature=0, max_tokens=1),
            use_tqdm=False,
        )
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    core = engine.engine_core
    result = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "kv_transfer_params": [o.kv_transfer_params for o in outs],
        "elapsed_s": elapsed,
    }
    json.dump(
        result, open(spec["out"] + ".partial.tmp", "w")
    )  # a producer's answer, before draining
    os.replace(spec["out"] + ".partial.tmp", spec["out"] + ".partial")
    deadline = time.monotonic() + spec.get("drain_s", 0)
    while core.has_pending_kv_transfers() and time.monotonic() < deadline:
        engine.step()
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    result.update(
        external=sched.num_external_computed_tokens,
        failed_loads=sched.num_failed_kv_loads,
        pending_sends=core.has_pending_kv_transfers(),
        free=pool.get_num_free_blocks(),
        total=pool.num_gpu_blocks - 1,
        kv_stats=sched.kv_connector_stats,
        refused_offers=getattr(sched.connector, "num_refused_offers", 0),
    )
    json.dump(result, open(spec["out"] + ".tmp", "w"))
    os.replace(spec["out"] + ".tmp", spec["out"])
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
