"""The engine with weight-only quantized weights (``quantization="int8"`` / ``"fp8"`` / ``"q4"``) against
the dense forward on the dequantized weights, and on two host devices (a subprocess)."""

from __future__ import annotations

import jax
import pytest

from jaxkv.engine_config import resolve_engine_config
from jaxkv.models.build import dequantized_model
from jaxkv.models.quant import QuantizedLinear
from jaxkv.models.registry import load_model
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.memory_profile import device_weight_bytes
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model
from tests.two_host_devices import run_cases_on_two_host_devices

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 15, 300, 7, 42], list(range(3, 40)), [9, 9, 9]]


@pytest.mark.slow  # ~45 s on 2 CPU cores: the 8-layer, 32000-vocabulary model compiled twice
@pytest.mark.parametrize("mode", ["int8", "fp8", "q4"])
def test_tiny_llama_greedy_equals_dense_on_dequantized_weights(mode):
    """The built-in tiny-llama loaded by name with ``quantization``: greedy tokens equal the
    dense forward's on the same weights dequantized to float32 (what the kernels hold)."""
    llm = make_llm("tiny-llama", quantization=mode, max_model_len=256)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    quantized, _, _ = load_model("tiny-llama", quantization=mode)  # the worker's weights
    ref = dequantized_model(quantized)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == dense_greedy(ref, prompt, 8), prompt
    assert_no_block_leaks(llm)


def test_model_object_is_quantized_in_place():
    model = small_model("tiny-llama")
    llm = make_llm(model, quantization="int8")
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = dequantized_model(model)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == dense_greedy(ref, prompt, 8), prompt


def test_weight_bytes_are_the_quantized_ones():
    """What the KV budget subtracts (``device_weight_bytes``, the parameters' bytes) is the
    int8 size: linear kernels and the head at a quarter of float32, the embedding float."""
    floats, config, _ = load_model("tiny-llama")
    int8, _, _ = load_model("tiny-llama", quantization="int8")
    embed = config.vocab_size * config.hidden_size * 4
    f, q = device_weight_bytes(floats), device_weight_bytes(int8)
    assert f == sum(x.nbytes for x in jax.tree.leaves(floats))
    assert q - embed < 0.26 * (f - embed)


def test_bad_quantization_value_is_refused():
    for bad in ("int4", "awq", 1, True):
        with pytest.raises(
            ValueError, match=r"quantization must be one of \('int8', 'fp8', 'q4'\)"
        ):
            resolve_engine_config("tiny-llama", quantization=bad)
    assert resolve_engine_config("tiny-llama")[3].quantization is None


@pytest.mark.slow
def test_two_host_devices():
    """Runs tests/engine/tp_quant_cases.py on two CPU devices; every case must pass."""
    run_cases_on_two_host_devices("tests/engine/tp_quant_cases.py")
