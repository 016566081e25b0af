"""Node 0 of a two-host engine, run inside a network namespace by the fault tests.

``python -m tests.distributed.netns_node SPEC.json``: ``{"engine": LLM kwargs (the multi-node
flags included), "prompts": [[ids]], "max_tokens": n, "rounds": r}``. Prints ``ready`` once
the engine is up (the workers on both hosts joined), then for each round one JSON line with
the greedy tokens and the free / total KV blocks after it (or ``{"error": type, "message": text,
"after_s": seconds}`` and exit 1).
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str) -> int:
    from jaxkv import LLM, SamplingParams

    spec = json.load(open(path))
    llm = LLM(spec.get("model", "tiny-llama"), **spec["engine"])
    print("ready", flush=True)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    for _ in range(spec.get("rounds", 1)):
        t0 = time.monotonic()
        try:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False
            )
        except Exception as exc:  # noqa: BLE001 - reported to the test
            print(
                json.dumps(
                    {
                        "error": type(exc).__name__,
                        "message": str(exc),
                        "after_s": time.monotonic() - t0,
                    }
                ),
                flush=True,
            )
            llm.shutdown()
            return 1
        pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
        print(
            json.dumps(
                {
                    "tokens": [o.outputs[0].token_ids for o in outs],
                    "seconds": time.monotonic() - t0,
                    "free_blocks": pool.get_num_free_blocks(),
                    "total_blocks": pool.num_gpu_blocks - 1,
                }
            ),
            flush=True,
        )
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
