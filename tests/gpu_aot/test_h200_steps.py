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


#: Two request buckets (1, 2) and token buckets 16, 24, 32, 48: ten step shapes with every
#: prefill tile size of the kernel (16, 32 and 64 rows) and a non-power-of-two T, where
#: max_num_seqs 4 / 64 tokens compiled 18 shapes of the same kinds.
SHAPES_ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=48)


@pytest.mark.slow
@pytest.mark.gpu_aot_full
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_every_warmup_shape_compiles(h200, family):
    """Every shape of ``warmup="all"`` compiles, and in each the KV buffers are aliased."""
    runner = pallas_runner(family, **SHAPES_ENGINE)
    cache = sum(b.nbytes for b in runner.buffers)
    shapes = runner.step_shapes(prefill=True)
    assert len(shapes) == 10 and {q for _, _, q in shapes} == {1, 16, 24, 32, 48}, shapes
    for T, S, q in shapes:
        assert compile_step(runner, h200, T, S, q).memory_analysis().alias_size_in_bytes >= cache


@pytest.mark.slow
@pytest.mark.gpu_aot_full
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_sampling_pooling_and_draft_variants_compile(h200, family):
    """Each sampling variant once (the sampler sees only the S rows' logits, so decode or
    mixed makes no difference to it), both pooling kinds, every step with drafts."""
    runner = pallas_runner(family, **SHAPES_ENGINE)
    for (params, outputs), (T, q) in zip(((SAMPLED, 0), (PENALISED, 0), (PENALISED, 2)),
                                         ((2, 1), (32, 32), (2, 1))):
        compile_step(runner, h200, T, 2, q, sampling=params, num_output_tokens=outputs)
    for pooling in (POOL_ROWS, POOL_ALL):
        compile_step(runner, h200, 32, 2, 32, pooling=pooling)
    spec = pallas_runner(family, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                         **SHAPES_ENGINE)
    shapes = spec.spec_step_shapes()
    assert len(shapes) >= 3, shapes
    for T, S, P in shapes:
        compile_step(spec, h200, T, S, T, spec_positions=P)


def test_runner_binding_is_not_changed(h200):
    """compile_runner_step compiles a GPU variant; the runner keeps its own (interpreted) step."""
    runner = pallas_runner("tiny-llama")
    before = dataclasses.asdict(runner.binding) if dataclasses.is_dataclass(runner.binding) else runner.binding
    compile_step(runner, h200, 4, 4, 1)
    after = dataclasses.asdict(runner.binding) if dataclasses.is_dataclass(runner.binding) else runner.binding
    assert before == after and runner.binding.interpret
