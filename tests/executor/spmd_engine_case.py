"""One process of a 2-process ``jax.distributed`` job running the whole in-process engine
SPMD (phase-1 proof that ``ModelRunner`` works over a mesh spanning processes): every process
has its own identical Scheduler, so every process feeds the same ``SchedulerOutput`` to its
runner, and the runners run one jitted step over the global 2-device "tp" mesh.

Usage: python -m tests.executor.spmd_engine_case RANK PORT OUT_JSON
"""

from __future__ import annotations

import json
import sys


def main(rank: int, port: int, out_path: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=rank,
        initialization_timeout=60,
    )
    import numpy as np

    from jaxkv.sampling_params import SamplingParams
    from tests.engine.helpers import make_llm, small_model

    assert jax.device_count() == 2 and len(jax.local_devices()) == 1
    model = small_model("tiny-llama")
    llm = make_llm(model, tensor_parallel_size=2, num_gpu_blocks_override=12, max_num_seqs=4)
    assert llm.llm_engine.runner.mesh.is_multi_process
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 512, size=40).tolist()
    prompts = [
        shared + rng.integers(3, 512, size=5).tolist(),
        rng.integers(3, 512, size=90).tolist(),
        shared + rng.integers(3, 512, size=7).tolist(),
    ]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    result = {
        "prompts": prompts,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "preemptions": llm.llm_engine.get_stats().num_preemptions,
    }
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
