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
from tests.executor.helpers import (
    ROOT,
    all_gone,
    executor_config,
    pid_alive,
    save_small_model,
    worker_env,
)

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
    prompts = [
        shared + rng.integers(3, 512, size=5).tolist(),
        rng.integers(3, 512, size=90).tolist(),
        shared + [5, 6, 7],
    ]
    llm.generate(
        prompts,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert eng.get_stats().num_preemptions > 0
    return steps, eng.config.max_model_len


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
        alone = [
            get_kv_cache_configs([s], [m], max_model_len=max_model_len)[0].num_blocks
            for s, m in zip(ex.get_kv_cache_specs(), mem)
        ]
        assert configs[0].num_blocks == configs[1].num_blocks == min(alone) < max(alone)
        configs = get_kv_cache_configs(
            ex.get_kv_cache_specs(), mem, max_model_len=max_model_len, num_gpu_blocks_override=12
        )
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
        assert ex.collective_rpc(rpc_funcs.fail_on_rank, args=(7,)) == [0, 1]  # still usable
        with pytest.raises(TypeError, match="result of type function cannot be pickled"):
            ex.collective_rpc(rpc_funcs.unpicklable)

        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=rf"worker rank 0 \(pid {pids[0]}\)"):
            ex.collective_rpc(rpc_funcs.sleep_on_rank, timeout=2.0, args=(0, 600))
        assert time.monotonic() - t0 < 10
        assert all_gone(pids)
        with pytest.raises(WorkerDiedError, match="executor is down"):
            ex.collective_rpc(rpc_funcs.whoami)
    finally:
        ex.shutdown()
    assert all_gone(pids, 0.1)


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
        with pytest.raises(
            WorkerDiedError, match=rf"worker rank 1 \(pid {pids[1]}\) died \(killed by signal 9\)"
        ):
            ex.collective_rpc(rpc_funcs.sleep_on_rank, args=(0, 30.0))  # rank 0 busy meanwhile
        assert time.monotonic() - t0 < 5
        assert all_gone(pids.values())
    finally:
        ex.shutdown()


_PARENT = """
import gc, os, sys, time
sys.path.insert(0, {root!r})
from tests.executor.helpers import executor_config
from jaxkv.executor.multiproc import MultiprocExecutor
ex = MultiprocExecutor(executor_config({path!r}, **{extra!r}))
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
@pytest.mark.parametrize("how", ["gc", "parent_killed", "node0_killed"])
def test_no_orphans(tiny, how):
    """Garbage collection of the executor stops its workers; so does SIGKILL of the process
    that started them (the workers watch their parent). With two nodes, SIGKILL of node 0's
    process also ends node 1's worker (its control socket disconnects) and node 1's launcher."""
    path, _ = tiny
    extra, launcher = {}, None
    if how == "node0_killed":
        port = _two_free_ports()
        extra = dict(nnodes=2, master_port=port)
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxkv.executor.headless",
                "--headless",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--tensor-parallel-size",
                "2",
            ],
            env=worker_env(),
            cwd=ROOT,
        )
    script = _PARENT.format(root=str(ROOT), path=str(path), extra=extra)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, how],
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
        if how == "gc":
            assert all_gone(pids, 1.0)  # gone before the parent exits
            assert proc.wait(timeout=60) == 0
        else:
            assert all(pid_alive(p) for p in pids)
            proc.kill()
            proc.wait(timeout=10)
            assert all_gone(pids, 10.0 if launcher else 5.0)
        if launcher is not None:
            assert launcher.wait(timeout=10) != 0
    finally:
        proc.kill()
        proc.wait()
        if launcher is not None:
            launcher.kill()
            launcher.wait()


def _two_free_ports() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (the coordinator and the control socket)."""
    import socket

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
def test_two_nodes_on_loopback_remote_worker_killed(tiny):
    """Node 1 is a separate ``--headless`` launcher process (one worker, rank 1); node 0 is this
    process's executor (one worker, rank 0). Killing node 1's worker (which this process cannot
    poll) is an error naming rank 1 and its pid; node 1's launcher then exits non-zero and no
    process is left. (Tokens over two nodes: test_multiproc_engine.py's
    test_two_nodes_on_loopback_through_jaxkv_generate.)"""
    path, _ = tiny
    port = _two_free_ports()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxkv.executor.headless",
            "--headless",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--tensor-parallel-size",
            "2",
        ],
        env=worker_env(),
        cwd=ROOT,
    )
    ex = None
    try:
        ex = MultiprocExecutor(executor_config(path, nnodes=2, master_port=port))
        pids = ex.worker_pids
        assert list(ex._ctl.procs) == [0]  # this node started rank 0 only
        who = ex.collective_rpc(rpc_funcs.whoami)
        assert [w["pid"] for w in who] == [pids[0], pids[1]] and [w["devices"] for w in who] == [
            2,
            2,
        ]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"worker rank 1 \(pid {pids[1]}"):
            ex.collective_rpc(rpc_funcs.sleep_on_rank, args=(0, 30.0))
        assert time.monotonic() - t0 < 10
        assert launcher.wait(timeout=10) != 0
        assert all_gone(pids.values())
    finally:
        if ex is not None:
            ex.shutdown()
        launcher.kill()
        launcher.wait()


def _worker_children() -> list[int]:
    """Pids of this process's live children that are worker processes (from /proc)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().split(")")[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"jaxkv.executor.worker_proc" in cmd:
            found.append(int(entry))
    return found


@pytest.mark.slow
def test_missing_node_is_a_timeout_naming_it(tiny):
    """nnodes=2 and no node 1: the start-up deadline names the missing rank and the command
    node 1 should run; this node's worker (waiting in jax.distributed.initialize) is stopped."""
    path, _ = tiny
    quick = type("QuickStart", (MultiprocExecutor,), {"startup_timeout_s": 6.0})
    port = _two_free_ports()
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        quick(executor_config(path, nnodes=2, master_port=port))
    assert time.monotonic() - t0 < 20
    assert str(info.value).startswith(
        "worker ranks [0, 1] did not start within 6 s; ranks [1] run on "
        f"other nodes: is `jaxkv generate --headless --nnodes 2 --node-rank "
        f"N --master-addr 127.0.0.1 --master-port {port}`"
    ), info.value
    assert _worker_children() == []
