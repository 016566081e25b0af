"""MultiprocExecutor on its own: two worker processes (one CPU device each, tensor parallel 2
across them) fed the ``SchedulerOutput`` s an in-process engine scheduled, per-rank KV
configs, errors, deadlines, dead workers and process clean-up. (The engine-level tests, with
``LLM(..., distributed_executor_backend="mp")``, are in test_multiproc_engine.py.)"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxkv.executor.multiproc import MultiprocExecutor, WorkerDiedError, WorkerTimeoutError
from jaxkv.kv_cache import get_kv_cache_configs
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import make_llm
from tests.executor import rpc_funcs
from tests.executor.helpers import ROOT, executor_config, pid_alive, save_small_model, worker_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process checks read /proc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp") / "tiny-llama"
    return path, save_small_model("tiny-llama", path)


def _record(model, max_tokens=12):
    """The SchedulerOutputs (pickled) and sampled tokens of an in-process engine on one device:
    chunked prefill (a 90-token prompt, 64-token budget), a prefix hit, a preemption (12 blocks)."""
    llm = make_llm(model, num_gpu_blocks_override=12, max_num_seqs=4)
    eng = llm.llm_engine
    steps, execute = [], eng.runner.execute_model

    def recording(so):
        out = execute(so)
        steps.append((pickle.dumps(so), out.sampled_token_ids))
        return out
    eng.runner.execute_model = recording
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 512, size=40).tolist()
    prompts = [shared + rng.integers(3, 512, size=5).tolist(), rng.integers(3, 512, size=90).tolist(),
               shared + [5, 6, 7]]
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    assert eng.get_stats()["num_preemptions"] > 0
    return steps, eng.config.max_model_len


def _gone(pids, within=5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_replay_per_rank_configs_and_errors(tiny):
    """Two workers, TP 2 across processes: each holds exactly configs[rank] (the block count is
    the minimum over workers), replayed steps (blocking and non-blocking) give the one-process
    engine's tokens, a worker's exception comes back as itself with the worker's traceback, and
    a hung worker is a timeout error after which no process is left."""
    path, model = tiny
    steps, max_model_len = _record(model)
    ex = MultiprocExecutor(executor_config(path, max_model_len=max_model_len))
    pids = list(ex.worker_pids.values())
    try:
        who = ex.collective_rpc(rpc_funcs.whoami)
        assert [w["rank"] for w in who] == [0, 1] == [w["process_index"] for w in who]
        assert all(w["local_devices"] == 1 and w["devices"] == 2 for w in who)
        assert [w["pid"] for w in who] == pids and os.getpid() not in pids
        mem = ex.collective_rpc(rpc_funcs.scale_memory, args=([1.0, 0.5],))
        assert ex.determine_available_memory() == mem and mem[1] < mem[0]
        configs = get_kv_cache_configs(ex.get_kv_cache_specs(), mem, max_model_len=max_model_len)
        alone = [get_kv_cache_configs([s], [m], max_model_len=max_model_len)[0].num_blocks
                 for s, m in zip(ex.get_kv_cache_specs(), mem)]
        assert configs[0].num_blocks == configs[1].num_blocks == min(alone) < max(alone)
        configs = get_kv_cache_configs(ex.get_kv_cache_specs(), mem, max_model_len=max_model_len,
                                       num_gpu_blocks_override=12)
        ex.initialize_from_config(configs)
        assert ex.collective_rpc(rpc_funcs.holds_config, args=(configs,)) == [True, True]
        for i, (blob, tokens) in enumerate(steps):
            if i % 2:
                out = ex.execute_model(pickle.loads(blob))
            else:
                fut = ex.execute_model(pickle.loads(blob), non_block=True)
                out = fut.result()
            assert out.sampled_token_ids == tokens, i

        with pytest.raises(ValueError, match="bad value on purpose in rank 1") as info:
            ex.collective_rpc(rpc_funcs.fail_on_rank, args=(1,))
        note = "\n".join(info.value.__notes__)
        assert f"worker rank 1 (pid {pids[1]})" in note and "in fail_on_rank" in note
        assert ex.collective_rpc(rpc_funcs.fail_on_rank, args=(7,)) == [0, 1]   # still usable

        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=rf"worker rank 0 \(pid {pids[0]}\)"):
            ex.collective_rpc(rpc_funcs.sleep_on_rank, timeout=2.0, args=(0, 600))
        assert time.monotonic() - t0 < 10
        assert _gone(pids)
        with pytest.raises(WorkerDiedError, match="executor is down"):
            ex.collective_rpc(rpc_funcs.whoami)
    finally:
        ex.shutdown()
    assert _gone(pids, 0.1)


@pytest.mark.slow
def test_killed_worker_is_an_error_naming_it(tiny):
    """SIGKILL of rank 1 between steps: the next step raises WorkerDiedError naming rank 1 and
    its pid within a few seconds, and every worker process is gone."""
    path, model = tiny
    ex = MultiprocExecutor(executor_config(path))
    pids = ex.worker_pids
    try:
        assert ex.collective_rpc(rpc_funcs.sleep_on_rank, args=(1, 0.0)) == [0, 1]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pids[1]}\) died \(killed by signal 9\)"):
            ex.collective_rpc(rpc_funcs.sleep_on_rank, args=(0, 30.0))   # rank 0 busy meanwhile
        assert time.monotonic() - t0 < 5
        assert _gone(pids.values())
    finally:
        ex.shutdown()


_PARENT = """
import gc, os, sys, time
sys.path.insert(0, {root!r})
from tests.executor.helpers import executor_config
from jaxkv.executor.multiproc import MultiprocExecutor
ex = MultiprocExecutor(executor_config({path!r}))
pids = list(ex.worker_pids.values())
if sys.argv[1] == "gc":
    del ex
    gc.collect()
    print("PIDS", *pids, flush=True)
else:
    print("PIDS", *pids, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gc", "parent_killed"])
def test_no_orphans(tiny, how):
    """Garbage collection of the executor stops its workers; so does SIGKILL of the process
    that started them (the workers watch their parent)."""
    path, _ = tiny
    proc = subprocess.Popen([sys.executable, "-c", _PARENT.format(root=str(ROOT), path=str(path)), how],
                            stdout=subprocess.PIPE, text=True, env=worker_env(), cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
        if how == "gc":
            assert _gone(pids, 1.0)   # gone before the parent exits
            assert proc.wait(timeout=60) == 0
        else:
            assert all(pid_alive(p) for p in pids)
            proc.kill()
            proc.wait(timeout=10)
            assert _gone(pids, 5.0)
    finally:
        proc.kill()
        proc.wait()


def _two_free_ports() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (the coordinator and the control socket)."""
    import socket  # noqa: PLC0415

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.slow
def test_two_nodes_on_loopback(tiny):
    """Node 1 is a separate ``--headless`` launcher process (one worker, rank 1); node 0 is this
    process's executor (one worker, rank 0): replayed steps give the one-process engine's
    tokens. Killing node 1's worker is an error naming rank 1; node 1's launcher then exits
    and no process is left."""
    path, model = tiny
    steps, max_model_len = _record(model)
    port = _two_free_ports()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxkv.executor.multiproc", "--headless", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--tensor-parallel-size", "2"],
        env=worker_env(), cwd=ROOT)
    ex = None
    try:
        ex = MultiprocExecutor(executor_config(path, max_model_len=max_model_len, nnodes=2, master_port=port))
        pids = ex.worker_pids
        assert list(ex._ctl.procs) == [0]   # this node started rank 0 only
        assert ex.collective_rpc(rpc_funcs.whoami)[1]["pid"] == pids[1]
        configs = get_kv_cache_configs(ex.get_kv_cache_specs(), ex.determine_available_memory(),
                                       max_model_len=max_model_len, num_gpu_blocks_override=12)
        ex.initialize_from_config(configs)
        for i, (blob, tokens) in enumerate(steps):
            assert ex.execute_model(pickle.loads(blob)).sampled_token_ids == tokens, i
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pids[1]}"):
            ex.collective_rpc(rpc_funcs.sleep_on_rank, args=(0, 30.0))
        assert time.monotonic() - t0 < 10
        assert launcher.wait(timeout=10) != 0
        assert _gone(pids.values())
    finally:
        if ex is not None:
            ex.shutdown()
        launcher.kill()
        launcher.wait()
