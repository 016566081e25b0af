"""Every engine step compiles for an NVIDIA H200, deviceless (see jaxkv.gpu_aot).

The steps run the Pallas Triton kernels (``attention_backend="pallas"``, not interpreted) and
are compiled to sm_90a machine code on this CPU-only machine: every shape ``warmup="all"``
compiles, with sampling, speculative-decoding and pooling variants, for tiny-llama and
tiny-hybrid (sliding windows, soft-caps). test_h200_memory_and_kernels.py has the test of
record and the kernels at realistic shapes.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.pooler import POOL_ALL, POOL_ROWS

from tests.gpu_aot.helpers import compile_step, pallas_runner

pytestmark = pytest.mark.gpu_aot

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, logprobs=2, max_tokens=8)
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=2, max_tokens=8)


@pytest.mark.slow
@pytest.mark.gpu_aot_full
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_every_warmup_shape_compiles(h200, family):
    runner = pallas_runner(family)
    shapes = runner.step_shapes(prefill=True)
    assert len(shapes) >= 8
    for T, S, q in shapes:
        compile_step(runner, h200, T, S, q)


@pytest.mark.slow
@pytest.mark.gpu_aot_full
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_sampling_pooling_and_draft_variants_compile(h200, family):
    runner = pallas_runner(family)
    for params, outputs in ((SAMPLED, 0), (PENALISED, 0), (PENALISED, 2)):
        compile_step(runner, h200, 4, 4, 1, sampling=params, num_output_tokens=outputs)
        compile_step(runner, h200, 64, 4, 64, sampling=params, num_output_tokens=outputs)
    for pooling in (POOL_ROWS, POOL_ALL):
        compile_step(runner, h200, 64, 4, 64, pooling=pooling)
    spec = pallas_runner(family, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    shapes = spec.spec_step_shapes()
    assert shapes
    for T, S, P in shapes:
        compile_step(spec, h200, T, S, T, spec_positions=P)


def test_runner_binding_is_not_changed(h200):
    """compile_runner_step compiles a GPU variant; the runner keeps its own (interpreted) step."""
    runner = pallas_runner("tiny-llama")
    before = dataclasses.asdict(runner.binding) if dataclasses.is_dataclass(runner.binding) else runner.binding
    compile_step(runner, h200, 4, 4, 1)
    after = dataclasses.asdict(runner.binding) if dataclasses.is_dataclass(runner.binding) else runner.binding
    assert before == after and runner.binding.interpret
