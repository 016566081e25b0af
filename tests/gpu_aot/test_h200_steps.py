"""Every program the engine runs compiles for an NVIDIA H200, deviceless (see jaxkv.gpu_aot).

The forwards run the Pallas Triton kernels (``attention_backend="pallas"``, not interpreted)
and are compiled to sm_90a machine code on this CPU-only machine: every program of the
engine's set (``ModelRunner.program_keys()``: forwards, samplers, prompt logprobs, the fixed
programs and, with n-gram drafts, the verifiers) for tiny-llama and tiny-hybrid (sliding
windows, soft-caps). test_h200_memory_and_kernels.py has the test of record and the kernels
at realistic shapes.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxkv.worker.program_set import FORWARD, GREEDY, SAMPLE, VERIFY, ProgramKey, num_programs
from tests.gpu_aot.helpers import compile_forward, compile_program, pallas_runner

pytestmark = pytest.mark.gpu_aot


#: Token buckets 1, 2, 16, 24, 32, 48 (every prefill tile size of the kernel: 16, 32 and 64
#: rows, and a non-power-of-two T) and request buckets 1, 2.
SHAPES_ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=48)


@pytest.mark.slow
@pytest.mark.gpu_aot_full
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_every_program_compiles(h200, family):
    """Every program warm-up compiles, compiled for the GPU; each forward keeps the KV buffers
    aliased (donated, updated in place)."""
    runner = pallas_runner(family, **SHAPES_ENGINE)
    b = runner.buckets
    assert b.tokens == (1, 2, 16, 24, 32, 48) and b.seqs == (1, 2), b
    keys = runner.program_keys()
    assert len(keys) == num_programs(num_token_buckets=6, num_seq_buckets=2) == 19
    cache = sum(x.nbytes for x in runner.buffers)
    for key in keys:
        compiled = compile_program(runner, h200, key)
        if key.kind == FORWARD:
            assert compiled.memory_analysis().alias_size_in_bytes >= cache, key


@pytest.mark.slow
@pytest.mark.gpu_aot_full
def test_verifiers_compile(h200):
    """With n-gram drafts: every verifier program (the forward is the same program)."""
    spec = pallas_runner(
        "tiny-llama",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **SHAPES_ENGINE,
    )
    keys = [k for k in spec.program_keys() if k.kind == VERIFY]
    assert [k.size for k in keys] == [1, 2, 4, 8], keys
    for key in keys:
        compile_program(spec, h200, key)


def test_runner_binding_is_not_changed(h200):
    """compile_runner_program compiles a GPU variant; the runner keeps its own (interpreted) one."""
    runner = pallas_runner("tiny-llama")
    before = dataclasses.asdict(runner.binding)
    compile_forward(runner, h200, 4)
    assert dataclasses.asdict(runner.binding) == before and runner.binding.interpret


@pytest.mark.parametrize("kind", [GREEDY, SAMPLE])
def test_one_row_heads_compile(h200, kind):
    """The heads of a one-request step take one row of the forward's P: jaxlib 0.10.2's
    XLA:GPU failed to compile that slice fused into the LM head's dot (heads.first_rows)."""
    from flax import nnx

    from tests.engine.helpers import make_llm, small_model

    # tiny-llama's own vocabulary and P = 64 (the bug needs both; the small test model's 512
    # tokens or P = 4 compiled); weights abstract
    model = nnx.eval_shape(lambda: small_model("tiny-llama", vocab_size=32000, hidden_size=512))
    runner = make_llm(
        model, attention_backend="pallas", max_num_seqs=64, max_model_len=256
    ).llm_engine.runner
    assert runner.buckets.num_sampled == 64 and runner.buckets.seqs[0] == 1
    compile_program(runner, h200, ProgramKey(kind, 1))
