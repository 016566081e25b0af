"""Per-worker KV memory: the largest step's temp memory read from its compiled (never run)
program, and vLLM's budget arithmetic."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jaxkv.kv_cache import kv_cache_specs_from_layers
from jaxkv.worker.memory_profile import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    PROFILE_SAMPLING,
    available_kv_bytes,
    device_weight_bytes,
    largest_step_temp_bytes,
    profile_largest_steps,
)
from tests.engine.helpers import make_llm, small_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)


def _engine_step_temp(runner, sampling):
    """The temp bytes of the engine's own largest prefill step, compiled from its real
    (allocated) arguments, as tests/engine/test_step_memory.py does."""
    T, S = runner.token_buckets[-1], runner.seq_buckets[-1]
    shape, packed = runner._empty_step(T, S, max_q_len=T, sampling=sampling)
    compiled = runner._step.lower(runner.state, runner.buffers, runner.tables, runner.last_sampled,
                                  jnp.asarray(packed), shape=shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("family, backend", [("tiny-llama", "cpu"), ("tiny-hybrid", "xla")])
def test_profile_equals_the_engines_compiled_step(family, backend):
    """Greedy and sampled variants each equal the engine's compiled step of the same shape
    (whose cache is 16 MiB; the profile's is 2 blocks), and the result is their max."""
    model = small_model(family)
    llm = make_llm(model, kv_cache_memory_bytes=16 << 20, attention_backend=backend, **LIMITS)
    runner = llm.llm_engine.runner
    specs = {g_name: g.kv_cache_spec for g in runner.config.kv_cache_groups for g_name in g.layer_names}
    kwargs = dict(LIMITS, attention_backend=backend, cache_dtype="float32",
                  eos_token_id=llm.llm_engine.input_processor.eos_token_id)
    steps = profile_largest_steps(model, specs, **kwargs)
    assert [(s.label, s.num_tokens, s.num_seqs) for s in steps] == [("greedy", 128, 8), ("sampled", 128, 8)]
    assert steps[0].temp_bytes == _engine_step_temp(runner, None)
    assert steps[1].temp_bytes == _engine_step_temp(runner, PROFILE_SAMPLING)
    assert largest_step_temp_bytes(model, specs, **kwargs) == max(s.temp_bytes for s in steps) > 0
    assert all(s.argument_bytes < 16 << 20 for s in steps)   # no real cache in the profile


def test_temp_does_not_depend_on_num_blocks_but_on_tokens():
    model = small_model("tiny-llama")
    specs = kv_cache_specs_from_layers(model.kv_layer_infos(), block_size=16, cache_dtype="float32")
    temp = {}
    for blocks in (2, 4096):
        temp[blocks] = [s.temp_bytes for s in profile_largest_steps(
            model, specs, num_blocks=blocks, attention_backend="xla", sampling=(None,), **LIMITS)]
    assert temp[2] == temp[4096]
    bigger = largest_step_temp_bytes(model, specs, attention_backend="xla", sampling=(None,),
                                     **dict(LIMITS, max_num_batched_tokens=256))
    assert bigger > temp[2][0]        # the profiled step is the prefill of the token budget


def test_speculative_decoding_adds_its_largest_step():
    model = small_model("tiny-llama")
    specs = kv_cache_specs_from_layers(model.kv_layer_infos(), block_size=16, cache_dtype="float32")
    from jaxkv.worker.spec_decode import SpeculativeConfig
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    steps = profile_largest_steps(model, specs, sampling=(None,), speculative_config=spec, **LIMITS)
    assert [(s.label, s.num_seqs, s.spec_positions) for s in steps] == [("greedy", 8, 0), ("speculative", 8, 32)]


def test_device_weight_bytes_one_device():
    model = small_model("tiny-llama")
    from flax import nnx
    import jax
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))
    assert device_weight_bytes(nnx.state(model)) == device_weight_bytes(model) == total


GiB = 2**30


def test_available_kv_bytes_arithmetic():
    stats = {"bytes_limit": 80 * GiB, "bytes_in_use": 17 * GiB}
    # limit x utilization - weights - step temp (bytes_in_use is not consulted)
    assert available_kv_bytes(stats, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                              weights_bytes=16 * GiB, step_temp_bytes=2 * GiB) == 54 * GiB
    assert available_kv_bytes(stats, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None,
                              weights_bytes=0, step_temp_bytes=0) == 40 * GiB
    # an explicit budget wins over everything
    assert available_kv_bytes(stats, gpu_memory_utilization=0.9, kv_cache_memory_bytes=3 << 20,
                              weights_bytes=100 * GiB, step_temp_bytes=0) == 3 << 20
    # CPU: no stats -> the configured budget
    for no_stats in (None, {}, {"bytes_in_use": 5}):
        assert available_kv_bytes(no_stats, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                                  weights_bytes=10 * GiB, step_temp_bytes=GiB) == DEFAULT_CPU_KV_CACHE_BYTES
    assert available_kv_bytes(None, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                              weights_bytes=0, step_temp_bytes=0, cpu_kv_cache_bytes=1 << 20) == 1 << 20


def test_available_kv_bytes_errors_print_the_numbers():
    stats = {"bytes_limit": 10 * GiB}
    kw = dict(gpu_memory_utilization=0.9, kv_cache_memory_bytes=None)
    with pytest.raises(ValueError, match=r"bytes_limit 10737418240 x gpu_memory_utilization 0\.9 = "
                                         r"9663676416, minus weights 9000000000, minus the largest "
                                         r"step's temp memory 700000000 = -36323584 bytes"):
        available_kv_bytes(stats, weights_bytes=9_000_000_000, step_temp_bytes=700_000_000, **kw)
    with pytest.raises(ValueError, match="= 0 bytes"):
        available_kv_bytes(stats, weights_bytes=int(9 * GiB * 1.0), step_temp_bytes=9663676416 - 9 * GiB, **kw)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive, got 0"):
        available_kv_bytes(stats, gpu_memory_utilization=0.9, kv_cache_memory_bytes=0,
                           weights_bytes=0, step_temp_bytes=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1\.5"):
        available_kv_bytes(stats, gpu_memory_utilization=1.5, kv_cache_memory_bytes=None,
                           weights_bytes=0, step_temp_bytes=0)
    with pytest.raises(ValueError, match="weights_bytes must be >= 0, got -1"):
        available_kv_bytes(stats, weights_bytes=-1, step_temp_bytes=0, **kw)
    with pytest.raises(TypeError, match="step_temp_bytes must be an int, got 1.5"):
        available_kv_bytes(stats, weights_bytes=0, step_temp_bytes=1.5, **kw)


def test_mesh_cases_on_two_host_devices():
    """Runs tests/worker/memory_profile_cases.py on two CPU devices; every case must pass."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/worker/memory_profile_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout and "deselected" not in proc.stdout, tail
