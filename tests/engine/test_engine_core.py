"""The engine's seams (vLLM V1's): EngineCore builds one KVCacheConfig per worker from what
the executor's workers report, each worker keeps configs[rank], and the core's process
needs no jax."""

import subprocess
import sys

import pytest

from jaxkv import SamplingParams
from jaxkv.core import ModelRunnerOutput
from jaxkv.engine.core import EngineCore
from jaxkv.engine_config import resolve_engine_config
from jaxkv.executor import Executor
from jaxkv.kv_cache import FullAttentionSpec
from jaxkv.worker.worker_base import WorkerWrapperBase

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
PAGE = SPEC.page_size_bytes


class _RecordingWorker:
    """Stands in for ``Worker`` in a WorkerWrapperBase: records the config it was given."""

    def __init__(self, memory):
        self.memory = memory
        self.kv_cache_config = None

    def get_kv_cache_spec(self):
        return {"layers.0": SPEC, "layers.1": SPEC}

    def determine_available_memory(self):
        return self.memory

    def initialize_from_config(self, config):
        self.kv_cache_config = config

    def compile_or_warm_up_model(self):
        return 0


class _StubExecutor(Executor):
    """Two ranks with different memory; the step returns one token per scheduled request."""

    MEMORY = (40 * 2 * PAGE, 25 * 2 * PAGE)  # 40 and 25 blocks' worth for two layers

    def _init_executor(self, model):
        self.wrappers = []
        for rank, mem in enumerate(self.MEMORY):
            w = WorkerWrapperBase(rpc_rank=rank)
            w.worker = _RecordingWorker(mem)
            self.wrappers.append(w)
        self.shut = False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [w.execute_method(method, *args, **(kwargs or {})) for w in self.wrappers]

    def execute_model(self, so, non_block=False):
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
        )

    def shutdown(self):
        self.shut = True


@pytest.fixture(scope="module")
def config():
    _, _, _, config = resolve_engine_config(
        "tiny-llama",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        warmup=False,
    )
    return config


def test_each_worker_keeps_its_own_config_and_blocks_are_the_minimum(config):
    core = EngineCore(config, _StubExecutor)
    held = [w.worker.kv_cache_config for w in core.model_executor.wrappers]
    assert (
        held == core.kv_cache_configs
        and held[0] is core.kv_cache_configs[0]
        and held[1] is core.kv_cache_configs[1]
    )
    assert [c.num_blocks for c in held] == [25, 25]  # the smaller worker's
    assert core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == 25


def test_wrapper_picks_its_rank_and_refuses_a_short_list():
    w = WorkerWrapperBase(rpc_rank=0, global_rank=1)
    w.worker = _RecordingWorker(0)
    w.initialize_from_config(["rank0", "rank1"])
    assert w.worker.kv_cache_config == "rank1"
    with pytest.raises(ValueError, match="worker rank 1 has no KV-cache config"):
        w.initialize_from_config(["rank0"])
    with pytest.raises(AttributeError, match="no method '_secret'"):
        w.execute_method("_secret")


def test_engine_core_steps_with_any_executor(config):
    from jaxkv.core import Request

    core = EngineCore(config, _StubExecutor)
    core.add_requests([Request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))])
    outs, so = core.step()
    assert so.num_scheduled_tokens == {"a": 3} and outs[0].new_token_ids == [7]
    outs, _ = core.step()
    assert outs[0].finish_reason == "length" and not core.has_unfinished_requests()
    core.shutdown()
    assert core.model_executor.shut


def test_a_failed_start_stops_the_workers(config):
    class Broken(_StubExecutor):
        MEMORY = (PAGE, PAGE)  # no room for one request

    shut = []
    Broken.shutdown = lambda self: shut.append(True)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineCore(config, Broken)
    assert shut == [True]


def test_unknown_executor_backend_is_refused(config):
    import dataclasses

    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        Executor.get_class(dataclasses.replace(config, distributed_executor_backend="ray"))
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        resolve_engine_config("tiny-llama", distributed_executor_backend="ray", warmup=False)
    with pytest.raises(ValueError, match="node_rank must be in"):
        resolve_engine_config(
            "tiny-llama",
            distributed_executor_backend="mp",
            nnodes=2,
            node_rank=2,
            master_port=1234,
            tensor_parallel_size=2,
            warmup=False,
        )


def test_uniproc_worker_holds_configs_rank_0():
    """Asserted from inside the worker through collective_rpc (a function run on the worker)."""
    from jaxkv import LLM

    llm = LLM("tiny-llama", kv_cache_memory_bytes=8 << 20, max_model_len=64, warmup=False)
    core = llm.llm_engine.engine_core
    held = core.model_executor.collective_rpc(lambda worker: worker.kv_cache_config)
    assert held == [core.kv_cache_configs[0]] and held[0] is core.kv_cache_config
    assert core.model_executor.collective_rpc(
        lambda worker: worker.model_runner.config is worker.kv_cache_config
    ) == [True]


def test_engine_core_process_needs_no_jax():
    """The engine core, the executor seam, the output processor: none imports jax."""
    code = (
        "import sys, jaxkv.engine.core, jaxkv.engine.output_processor, jaxkv.executor; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
