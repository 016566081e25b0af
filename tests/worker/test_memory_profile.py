"""Per-worker KV memory: the largest step's temp memory read from its compiled (never run)
program, and vLLM's budget arithmetic."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxkv.kv_cache import kv_cache_specs_from_layers
from jaxkv.worker.memory_profile import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    available_kv_bytes,
    device_weight_bytes,
    largest_step_temp_bytes,
    profile_largest_programs,
)
from jaxkv.worker.program_set import ProgramKey
from jaxkv.worker.spec_decode import SpeculativeConfig
from tests.engine.helpers import make_llm, small_model
from tests.two_host_devices import run_cases_on_two_host_devices

LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)


def _engine_program_temp(runner, key: str):
    """The temp bytes of the engine's own program (``runner.programs``: what it runs, its
    real 16 MiB cache), as tests/engine/test_step_memory.py reads them."""
    kind, size = key.rstrip("]").split("[")
    return runner.programs.get(ProgramKey(kind, int(size))).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("family, backend", [("tiny-llama", "cpu"), ("tiny-hybrid", "xla")])
def test_profile_equals_the_engines_compiled_programs(family, backend):
    """The largest forward, sampler and prompt-logprob programs each equal the engine's own
    (whose cache is 16 MiB; the profile's is 2 blocks), and the result is their max."""
    model = small_model(family)
    llm = make_llm(model, kv_cache_memory_bytes=16 << 20, attention_backend=backend, **LIMITS)
    runner = llm.llm_engine.runner
    specs = {
        g_name: g.kv_cache_spec for g in runner.config.kv_cache_groups for g_name in g.layer_names
    }
    kwargs = dict(
        LIMITS,
        attention_backend=backend,
        cache_dtype="float32",
        eos_token_id=llm.llm_engine.input_processor.eos_token_id,
    )
    steps = profile_largest_programs(model, specs, **kwargs)
    assert [s.program for s in steps] == ["forward[128]", "sample[8]", "prompt_logprobs[128]"]
    for s in steps:
        assert s.temp_bytes == _engine_program_temp(runner, s.program), s.program
    assert largest_step_temp_bytes(model, specs, **kwargs) == max(s.temp_bytes for s in steps) > 0
    assert all(s.argument_bytes < 16 << 20 for s in steps)  # no real cache in the profile


def test_temp_does_not_depend_on_num_blocks_but_on_tokens():
    model = small_model("tiny-llama")
    specs = kv_cache_specs_from_layers(model.kv_layer_infos(), block_size=16, cache_dtype="float32")
    temp = {}
    for blocks in (2, 4096):
        temp[blocks] = [
            s.temp_bytes
            for s in profile_largest_programs(
                model, specs, num_blocks=blocks, attention_backend="xla", **LIMITS
            )
        ]
    assert temp[2] == temp[4096]
    bigger = profile_largest_programs(
        model, specs, attention_backend="xla", **dict(LIMITS, max_num_batched_tokens=256)
    )
    assert bigger[0].temp_bytes > temp[2][0]  # the profiled forward is the token budget's


def test_speculative_decoding_adds_its_largest_step():
    model = small_model("tiny-llama")
    specs = kv_cache_specs_from_layers(model.kv_layer_infos(), block_size=16, cache_dtype="float32")
    spec = SpeculativeConfig.from_value(
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    )
    steps = profile_largest_programs(model, specs, speculative_config=spec, **LIMITS)
    assert [s.program for s in steps] == [
        "forward[128]",
        "sample[8]",
        "verify[32]",
        "prompt_logprobs[128]",
    ]


def test_device_weight_bytes_one_device():
    model = small_model("tiny-llama")
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))
    assert device_weight_bytes(nnx.state(model)) == device_weight_bytes(model) == total


GiB = 2**30


def test_available_kv_bytes_arithmetic():
    stats = {"bytes_limit": 80 * GiB, "bytes_in_use": 17 * GiB}
    # limit x utilization - weights - step temp (bytes_in_use is not consulted)
    assert (
        available_kv_bytes(
            stats,
            gpu_memory_utilization=0.9,
            kv_cache_memory_bytes=None,
            weights_bytes=16 * GiB,
            step_temp_bytes=2 * GiB,
        )
        == 54 * GiB
    )
    assert (
        available_kv_bytes(
            stats,
            gpu_memory_utilization=0.5,
            kv_cache_memory_bytes=None,
            weights_bytes=0,
            step_temp_bytes=0,
        )
        == 40 * GiB
    )
    # an explicit budget wins over everything
    assert (
        available_kv_bytes(
            stats,
            gpu_memory_utilization=0.9,
            kv_cache_memory_bytes=3 << 20,
            weights_bytes=100 * GiB,
            step_temp_bytes=0,
        )
        == 3 << 20
    )
    # CPU: no stats -> the configured budget
    for no_stats in (None, {}, {"bytes_in_use": 5}):
        assert (
            available_kv_bytes(
                no_stats,
                gpu_memory_utilization=0.9,
                kv_cache_memory_bytes=None,
                weights_bytes=10 * GiB,
                step_temp_bytes=GiB,
            )
            == DEFAULT_CPU_KV_CACHE_BYTES
        )
    assert (
        available_kv_bytes(
            None,
            gpu_memory_utilization=0.9,
            kv_cache_memory_bytes=None,
            weights_bytes=0,
            step_temp_bytes=0,
            cpu_kv_cache_bytes=1 << 20,
        )
        == 1 << 20
    )


def test_available_kv_bytes_errors_print_the_numbers():
    stats = {"bytes_limit": 10 * GiB}
    kw = dict(gpu_memory_utilization=0.9, kv_cache_memory_bytes=None)
    with pytest.raises(
        ValueError,
        match=r"bytes_limit 10737418240 x gpu_memory_utilization 0\.9 = "
        r"9663676416, minus weights 9000000000, minus the largest "
        r"step's temp memory 700000000 = -36323584 bytes",
    ):
        available_kv_bytes(stats, weights_bytes=9_000_000_000, step_temp_bytes=700_000_000, **kw)
    with pytest.raises(ValueError, match="= 0 bytes"):
        available_kv_bytes(
            stats, weights_bytes=int(9 * GiB * 1.0), step_temp_bytes=9663676416 - 9 * GiB, **kw
        )
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive, got 0"):
        available_kv_bytes(
            stats,
            gpu_memory_utilization=0.9,
            kv_cache_memory_bytes=0,
            weights_bytes=0,
            step_temp_bytes=0,
        )
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1\.5"):
        available_kv_bytes(
            stats,
            gpu_memory_utilization=1.5,
            kv_cache_memory_bytes=None,
            weights_bytes=0,
            step_temp_bytes=0,
        )
    with pytest.raises(ValueError, match="weights_bytes must be >= 0, got -1"):
        available_kv_bytes(stats, weights_bytes=-1, step_temp_bytes=0, **kw)
    with pytest.raises(TypeError, match="step_temp_bytes must be an int, got 1.5"):
        available_kv_bytes(stats, weights_bytes=0, step_temp_bytes=1.5, **kw)


def test_mesh_cases_on_two_host_devices():
    """Runs tests/worker/memory_profile_cases.py on two CPU devices; every case must pass."""
    run_cases_on_two_host_devices("tests/worker/memory_profile_cases.py")
