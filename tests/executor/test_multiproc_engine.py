"""``LLM(..., distributed_executor_backend="mp")``: the engine core here, two worker processes
(tensor parallel 2 across them, one CPU device each, gloo collectives) against the one-process
engine and the dense forward; a worker killed mid-generation; clean-up."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from jaxkv.entrypoints.llm import LLM
from jaxkv.executor.multiproc import WorkerDiedError
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy
from tests.executor import rpc_funcs
from tests.executor.helpers import pid_alive, save_small_model

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process checks read /proc")

SMALL = dict(kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=64, block_size=16, warmup=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp-engine")
    return {f: (root / f, save_small_model(f, root / f)) for f in ("tiny-llama", "tiny-hybrid")}


def _mp(path, **kw) -> LLM:
    args = dict(SMALL, distributed_executor_backend="mp", tensor_parallel_size=2)
    args.update(kw)
    return LLM(str(path), **args)


def _workload(seed=0):
    """Chunked prefill (90 tokens in a 64-token budget), prefix hits (a shared 40-token
    prefix), and with 12 blocks of KV, preemption."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 512, size=40).tolist()
    first = [shared + rng.integers(3, 512, size=5).tolist(), rng.integers(3, 512, size=90).tolist()]
    later = [shared + rng.integers(3, 512, size=n).tolist() for n in (7, 3, 12)] + \
        [rng.integers(3, 512, size=30).tolist()]
    return first, later


def _run(llm, first, later, params):
    outs = llm.generate(first, params, use_tqdm=False)
    return outs + llm.generate(later, params, use_tqdm=False)


def _gone(pids, within=5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_llama_matches_one_process_and_dense(models):
    """Greedy tokens equal the dense forward's and the one-process engine's (chunked prefill,
    prefix hits, preemption); seeded sampling draws what one process draws; each worker holds
    exactly configs[rank] (checked inside the worker); shutdown() leaves no process."""
    path, model = models["tiny-llama"]
    first, later = _workload()
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    one = LLM(str(path), num_gpu_blocks_override=12, max_num_seqs=4, **SMALL)
    ref = _run(one, first, later, greedy)
    ref_seeded = one.generate(first, seeded, use_tqdm=False)
    llm = _mp(path, num_gpu_blocks_override=12, max_num_seqs=4)
    core = llm.llm_engine.engine_core
    ex = core.model_executor
    pids = list(ex.worker_pids.values())
    try:
        assert ex.collective_rpc(rpc_funcs.holds_config, args=(core.kv_cache_configs,)) == [True, True]
        assert [w["process_index"] for w in ex.collective_rpc(rpc_funcs.whoami)] == [0, 1]
        outs = _run(llm, first, later, greedy)
        for p, o, r in zip(first + later, outs, ref):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids == dense_greedy(model, p, 16), p[:4]
        assert any(o.num_cached_tokens >= 32 for o in outs[2:5]), [o.num_cached_tokens for o in outs]
        assert llm.llm_engine.get_stats()["num_preemptions"] > 0
        assert_no_block_leaks(llm)
        got = llm.generate(first, seeded, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref_seeded]
    finally:
        llm.shutdown()
    assert _gone(pids, 1.0)


@pytest.mark.slow
def test_hybrid_sliding_window_async(models):
    """The hybrid model (sliding-window + full layers: two KV groups; soft-caps, tied
    embedding) under async scheduling (non-blocking execute_model) equals the dense forward."""
    path, model = models["tiny-hybrid"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (40, 9, 70)]
    llm = _mp(path, async_scheduling=True, max_num_seqs=4)
    try:
        assert len(llm.llm_engine.kv_cache_config.kv_cache_groups) == 2
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == dense_greedy(model, p, 20)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_worker_killed_mid_generation(models):
    """SIGKILL of worker rank 1 while generate() runs: the caller gets an error naming rank 1
    and its pid within a few seconds, no worker is left, and a new LLM afterwards works (and
    garbage collection of it stops its workers)."""
    path, model = models["tiny-llama"]
    llm = _mp(path, max_num_seqs=4)
    pids = llm.llm_engine.engine_core.model_executor.worker_pids
    killed = []

    def kill():
        killed.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)
    timer = threading.Timer(3.0, kill)
    prompt = list(range(3, 40))
    timer.start()
    try:
        with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pids[1]}\) died") as info:
            llm.generate([prompt] * 2, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    finally:
        timer.cancel()
    assert killed and time.monotonic() - killed[0] < 5, info.value
    assert _gone(pids.values(), 2.0)
    llm.shutdown()

    again = _mp(path, max_num_seqs=4)
    new_pids = list(again.llm_engine.engine_core.model_executor.worker_pids.values())
    (out,) = again.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    assert out.outputs[0].token_ids == dense_greedy(model, prompt, 6)
    del again, out
    gc.collect()
    assert _gone(new_pids, 5.0)
