"""Worker start-up: the front end reads a named model's config only, the worker
loads the weights, and each worker reports the bytes it has for KV: the configured budget on
CPU, ``bytes_limit x gpu_memory_utilization - weights - the largest step's temp`` on a
device with memory stats (faked here), from which the engine core sizes ``num_blocks``."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

import jaxkv.models.registry as registry
from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES, resolve_engine_config
from jaxkv.models import hf_state_dict
from jaxkv.models.checkpoint import write_safetensors_dir
from jaxkv.models.checkpoint.safetensors_dir import SafetensorsTensors
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker import worker as worker_module
from jaxkv.worker.worker import Worker
from tests.engine.helpers import dense_greedy, make_llm, small_model
from tests.models.ckpt_fixtures import hf_config_dict

LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
ACCELERATOR = dict(LIMITS, kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
GiB = 2**30


class FakeDevice:
    """A device that reports memory stats, as an accelerator does (CPU devices report none)."""

    def __init__(self, bytes_limit: int | None):
        self.bytes_limit = bytes_limit

    def memory_stats(self):
        return (
            None
            if self.bytes_limit is None
            else {"bytes_limit": self.bytes_limit, "bytes_in_use": 0}
        )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Llama as an HF safetensors directory (a model name the workers load), and
    the same model built in process (the dense reference)."""
    model = small_model("tiny-llama", seed=5)
    path = tmp_path_factory.mktemp("ckpt") / "small-llama"
    write_safetensors_dir(path, hf_config_dict(model.config), hf_state_dict(model))
    return str(path), model


@pytest.fixture
def worker_calls(monkeypatch):
    """Records what each worker reported for KV and the step temp it subtracted."""
    calls = {"available": [], "temp": [], "profiled": []}
    real_available, real_temp = (
        Worker.determine_available_memory,
        worker_module.largest_step_temp_bytes,
    )

    def available(self):
        calls["available"].append(real_available(self))
        return calls["available"][-1]

    def temp(model, specs, **kwargs):
        calls["profiled"].append((model, specs, kwargs))
        calls["temp"].append(real_temp(model, specs, **kwargs))
        return calls["temp"][-1]

    monkeypatch.setattr(Worker, "determine_available_memory", available)
    monkeypatch.setattr(worker_module, "largest_step_temp_bytes", temp)
    return calls


def _fake_devices(monkeypatch, bytes_limit: int) -> None:
    """Every worker started from now on sees one device with ``bytes_limit``."""
    real = Worker.init_device

    def init_device(self):
        real(self)
        self.devices = [FakeDevice(bytes_limit)]

    monkeypatch.setattr(Worker, "init_device", init_device)


def _worker(llm) -> Worker:
    return llm.llm_engine.engine_core.model_executor.driver_worker.worker


def _param_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))


def test_front_end_reads_no_weights_and_the_worker_loads_once(
    checkpoint, monkeypatch, worker_calls
):
    """A model named by path: resolve_engine_config reads its config only (no tensor read,
    no parameter built); the worker loads it once, on its mesh (None: one device), reports
    the configured budget (CPU) without profiling, and greedy tokens equal the dense
    forward of the checkpoint's model."""
    path, model = checkpoint

    def no_weights(*args, **kwargs):
        raise AssertionError("the front end touched the weights")

    with monkeypatch.context() as m:
        m.setattr(SafetensorsTensors, "read", no_weights)
        m.setattr(registry, "load_model", no_weights)
        m.setattr(registry, "build_model", no_weights)
        loaded, config, _, engine_config = resolve_engine_config(path, **LIMITS, warmup=False)
    assert loaded is None and engine_config.model == path and config == model.config
    loads = []
    real_load = registry.load_model
    monkeypatch.setattr(
        registry, "load_model", lambda *a, **k: loads.append(k) or real_load(*a, **k)
    )
    llm = make_llm(path, **LIMITS)
    assert [k["mesh"] for k in loads] == [None]
    assert worker_calls["available"] == [8 << 20] and not worker_calls["profiled"]
    prompt = list(range(3, 20))
    (out,) = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert out.outputs[0].token_ids == dense_greedy(model, prompt, 6)


def test_cpu_budget_is_the_configured_one(checkpoint, worker_calls):
    """CPU devices report no memory stats: kv_cache_memory_bytes, else the default budget
    (asked of a bare worker: nothing of that size is allocated); num_blocks follows."""
    llm = make_llm(checkpoint[0], **LIMITS, kv_cache_memory_bytes=3 << 20)
    assert worker_calls["available"] == [3 << 20] and not worker_calls["profiled"]
    config = llm.llm_engine.kv_cache_config
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert config.num_blocks == (3 << 20) // page // len(config.kv_cache_tensors)
    worker = Worker(resolve_engine_config(checkpoint[0], **LIMITS, kv_cache_memory_bytes=None)[3])
    worker.init_device()
    worker.load_model()
    assert (
        worker.determine_available_memory() == DEFAULT_CPU_KV_CACHE_BYTES
        and not worker_calls["profiled"]
    )


def _sampling_state_bytes(worker) -> int:
    """What the runner's device sampling state holds (it lives beside the weights)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(worker.model_runner.sampling_state))


def test_accelerator_memory_is_limit_x_util_minus_weights_minus_step_temp(
    checkpoint, monkeypatch, worker_calls
):
    """With a device reporting a 16 MiB limit at utilization 0.5: the worker reports
    8 MiB - weights - the device sampling state - the temp of the largest compiled program,
    which it profiled with the engine's own limits and KV specs; num_blocks follows from that."""
    _fake_devices(monkeypatch, 16 << 20)
    llm = make_llm(checkpoint[0], **ACCELERATOR)
    worker = _worker(llm)
    (temp,), ((model, specs, kwargs),) = worker_calls["temp"], worker_calls["profiled"]
    assert model is worker.model and specs == worker.get_kv_cache_spec() and kwargs["mesh"] is None
    assert {k: kwargs[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")} == {
        k: LIMITS[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
    }
    assert kwargs["attention_backend"] == "auto" and 0 < temp < 4 << 20
    weights = _param_bytes(worker.model) + _sampling_state_bytes(worker)
    assert worker_calls["available"] == [(8 << 20) - weights - temp]
    config = llm.llm_engine.kv_cache_config
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert config.num_blocks == ((8 << 20) - weights - temp) // page // len(config.kv_cache_tensors)
    assert sum(b.nbytes for b in llm.llm_engine.runner.buffers) <= (8 << 20) - weights - temp


def test_override_wins_and_too_little_memory_names_the_terms(checkpoint, monkeypatch, worker_calls):
    """num_gpu_blocks_override still sets num_blocks; a limit that leaves nothing for KV is a
    ValueError printing each term (temp faked: 1 MiB)."""
    monkeypatch.setattr(worker_module, "largest_step_temp_bytes", lambda *a, **k: 1 << 20)
    _fake_devices(monkeypatch, 16 << 20)
    llm = make_llm(checkpoint[0], **ACCELERATOR, num_gpu_blocks_override=5)
    assert llm.llm_engine.kv_cache_config.num_blocks == 5
    worker = _worker(llm)
    assert worker_calls["available"] == [
        (7 << 20) - _param_bytes(worker.model) - _sampling_state_bytes(worker)
    ]
    _fake_devices(monkeypatch, 2 << 20)
    with pytest.raises(
        ValueError,
        match=r"bytes_limit 2097152 x gpu_memory_utilization 0.5 .*temp "
        r"memory 1048576",
    ):
        make_llm(checkpoint[0], **ACCELERATOR)


def test_memory_stats_of_the_smallest_device():
    """A worker over several devices measures the one with the smallest limit; any device
    without stats (CPU) means the configured budget."""
    worker = Worker(config=None)
    worker.devices = [FakeDevice(8 * GiB), FakeDevice(4 * GiB), FakeDevice(6 * GiB)]
    assert worker.device_memory_stats()["bytes_limit"] == 4 * GiB
    worker.devices = [FakeDevice(8 * GiB), FakeDevice(None)]
    assert worker.device_memory_stats() is None
    worker.devices = jax.local_devices()[:1]
    assert jax.default_backend() != "cpu" or worker.device_memory_stats() is None


def test_a_built_model_is_served_as_given():
    """LLM(model object): the worker serves that object (nothing is loaded by name; its
    tokens are checked by the engine tests, which all build their models)."""
    model = small_model("tiny-llama", seed=5)
    llm = make_llm(model, **LIMITS)
    assert _worker(llm).model is model and llm.llm_engine.config.model is None
