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

from jaxkv.core.errors import EngineStepError
from jaxkv.entrypoints.llm import LLM
from jaxkv.executor.multiproc import WorkerDiedError, WorkerTimeoutError
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy
from tests.executor import rpc_funcs
from tests.executor.helpers import all_gone, save_small_model

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
    later = [shared + rng.integers(3, 512, size=n).tolist() for n in (7, 3, 12)] + [
        rng.integers(3, 512, size=30).tolist()
    ]
    return first, later


def _run(llm, first, later, params):
    outs = llm.generate(first, params, use_tqdm=False)
    return outs + llm.generate(later, params, use_tqdm=False)


@pytest.mark.slow
def test_int8_weights_across_two_processes_match_one_process(models):
    """``quantization="int8"`` with the workers in two processes (tensor parallel 2): each
    worker holds its half of the int8 kernels and the greedy tokens are the one-process
    engine's."""
    path, _ = models["tiny-llama"]
    first, later = _workload(1)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = LLM(str(path), quantization="int8", max_num_seqs=4, **SMALL)
    ref = _run(one, first, later, greedy)
    one.shutdown()
    llm = _mp(path, quantization="int8", max_num_seqs=4)
    try:
        ex = llm.llm_engine.engine_core.model_executor
        (dtype, shard), other = (tuple(r) for r in ex.collective_rpc(rpc_funcs.q_proj_shard))
        assert dtype == "int8" and other == (dtype, shard), other
        hidden = llm.llm_engine.model_config.hidden_size
        assert shard[0] == hidden and shard[1] < hidden  # columns split over the two ranks
        outs = _run(llm, first, later, greedy)
        assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
        assert_no_block_leaks(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_llama_matches_one_process_and_dense(models):
    """Greedy tokens equal the dense forward's and the one-process engine's (chunked prefill,
    prefix hits, preemption); seeded sampling draws what one process draws; each worker holds
    exactly configs[rank] (checked inside the worker); a step that raises in the workers is the
    caller's EngineStepError caused by the worker's exception, with its traceback, and the
    engine carries on; shutdown() leaves no process."""
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
        assert ex.collective_rpc(rpc_funcs.holds_config, args=(core.kv_cache_configs,)) == [
            True,
            True,
        ]
        assert [w["process_index"] for w in ex.collective_rpc(rpc_funcs.whoami)] == [0, 1]
        outs = _run(llm, first, later, greedy)
        for p, o, r in zip(first + later, outs, ref):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids == dense_greedy(model, p, 16), (
                p[:4]
            )
        assert any(o.num_cached_tokens >= 32 for o in outs[2:5]), [
            o.num_cached_tokens for o in outs
        ]
        assert llm.llm_engine.get_stats().num_preemptions > 0
        assert_no_block_leaks(llm)
        got = llm.generate(first, seeded, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref_seeded]

        # a step that raises in every worker: the caller gets the worker's exception (with its
        # traceback) as the EngineStepError's cause; the engine recovers through the workers
        assert ex.collective_rpc(rpc_funcs.fail_next_dispatch) == [0, 1]
        with pytest.raises(EngineStepError) as info:
            llm.generate(first[:1], greedy, use_tqdm=False)
        cause = info.value.__cause__
        assert isinstance(cause, ValueError) and "dispatch failed on purpose in rank" in str(cause)
        note = "\n".join(cause.__notes__)
        assert "raised in worker rank" in note and "in failing" in note, note
        assert_no_block_leaks(llm)
        (again,) = llm.generate(first[:1], greedy, use_tqdm=False)
        assert again.outputs[0].token_ids == ref[0].outputs[0].token_ids

        # a step that raises in rank 1 only: rank 0 waits in the step's collectives for a
        # peer that never comes; found within collective_timeout_s, not execute_timeout_s
        ex.collective_timeout_s = 4.0
        assert ex.collective_rpc(rpc_funcs.fail_next_dispatch_on, args=(1,)) == [0, 1]
        t0 = time.monotonic()
        with pytest.raises((WorkerTimeoutError, WorkerDiedError)) as info:  # the executor is down
            llm.generate(first[:1], greedy, use_tqdm=False)
        message = str(info.value)
        assert time.monotonic() - t0 < ex.collective_timeout_s + 10, message
        assert f"worker rank 1 (pid {pids[1]}) raised ValueError" in message, message
        assert f"worker rank 0 (pid {pids[0]}) did not finish it" in message, message
        assert all_gone(pids, 2.0)
    finally:
        llm.shutdown()
    assert all_gone(pids, 1.0)


@pytest.mark.slow
def test_hybrid_sliding_window_async_then_stopped_worker(models):
    """The hybrid model (sliding-window + full layers: two KV groups; soft-caps, tied
    embedding) under async scheduling (non-blocking execute_model) equals the dense forward.
    Then SIGSTOP of the driver worker mid-generation (a hung process: it has not exited, so
    only its missing heartbeats tell): WorkerDiedError naming it within the heartbeat timeout,
    and no process is left (SIGKILL ends a stopped process)."""
    path, model = models["tiny-hybrid"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (40, 9, 70)]
    llm = _mp(path, async_scheduling=True, max_num_seqs=4)
    ex = llm.llm_engine.engine_core.model_executor
    pids = ex.worker_pids
    stopped = []

    def stop():
        stopped.append(time.monotonic())
        os.kill(pids[0], signal.SIGSTOP)

    timer = threading.Timer(1.0, stop)
    try:
        assert len(llm.llm_engine.kv_cache_config.kv_cache_groups) == 2
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == dense_greedy(model, p, 20)
        timer.start()
        with pytest.raises(
            WorkerDiedError, match=rf"worker rank 0 \(pid {pids[0]}\) sent no heartbeat"
        ):
            llm.generate(
                prompts[:1],
                SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )
        assert stopped and time.monotonic() - stopped[0] < ex.heartbeat_timeout_s + 5
        assert all_gone(pids.values(), 2.0)
    finally:
        timer.cancel()
        llm.shutdown()  # SIGKILL ends a stopped worker too


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
            llm.generate(
                [prompt] * 2,
                SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )
    finally:
        timer.cancel()
    assert killed and time.monotonic() - killed[0] < 5, info.value
    assert all_gone(pids.values(), 2.0)
    llm.shutdown()

    again = _mp(path, max_num_seqs=4)
    new_pids = list(again.llm_engine.engine_core.model_executor.worker_pids.values())
    (out,) = again.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert out.outputs[0].token_ids == dense_greedy(model, prompt, 6)
    del again, out
    gc.collect()
    assert all_gone(new_pids, 5.0)


@pytest.mark.slow
def test_two_nodes_on_loopback_through_jaxkv_generate(tmp_path):
    """vLLM's two-node command lines on one machine, each node its own launcher process:
    node 1 runs ``jaxkv generate --headless`` (run_headless: one worker, rank 1, no model, no
    prompts), node 0 ``jaxkv generate --nnodes 2 --node-rank 0`` (the engine and worker rank
    0); each worker has two CPU devices (``--devices-per-worker 2``), so tensor parallel 4
    spans the two processes. The printed greedy tokens equal the dense forward's, through
    chunked prefill (a 90-token prompt, 64-token steps), prefix hits and preemption (12
    blocks); node 0's exit shuts node 1's worker down, and its launcher then exits 0."""
    import re
    import subprocess

    from tests.executor.helpers import ROOT, worker_env
    from tests.executor.test_multiproc_executor import _two_free_ports

    path = tmp_path / "tiny-llama-kv4"
    model = save_small_model("tiny-llama", path, num_key_value_heads=4)  # 4 KV heads: TP 4
    first, later = _workload()
    prompts = first + later
    port = _two_free_ports()
    cli = [sys.executable, "-m", "jaxkv.entrypoints.cli", "generate"]
    nodes = [
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-tp",
        "4",
        "--devices-per-worker",
        "2",
    ]
    node1 = subprocess.Popen(
        cli + nodes + ["--headless", "--node-rank", "1"],
        env=worker_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ids = [a for p in prompts for a in ("--prompt-token-ids", ",".join(map(str, p)))]
        node0 = subprocess.run(
            cli
            + nodes
            + [
                "--node-rank",
                "0",
                "--model",
                str(path),
                "--max-tokens",
                "10",
                "--warmup",
                "off",
                "--kv-cache-memory",
                "96KiB",
                "--max-model-len",
                "128",
                "--max-num-seqs",
                "4",
                "--max-num-batched-tokens",
                "64",
            ]
            + ids,
            env=worker_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert node0.returncode == 0, node0.stderr[-3000:]
        out = node0.stdout
        got = [list(map(int, line.split())) for line in re.findall(r"^(\d+(?: \d+)*)$", out, re.M)]
        assert got == [dense_greedy(model, p, 10) for p in prompts], out
        assert "x 4 (tensor parallel), 2 worker processes on 2 nodes" in out, out
        assert "KV cache: 12 blocks" in out, out
        assert int(re.search(r"prefix-cache hits (\d+)", out)[1]) >= 32, out
        assert int(re.search(r"preemptions (\d+)", out)[1]) > 0, out
        assert node1.wait(timeout=30) == 0, node1.stderr.read()[-3000:]
    finally:
        node1.kill()
        node1.communicate()
