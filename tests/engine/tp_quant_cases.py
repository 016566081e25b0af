"""Quantized weights under tensor parallelism on two devices, against one device.

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``):
``test_quantized_engine.py`` runs it in a subprocess with two CPU host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``). On a machine with two or more
accelerators it runs as is: ``pytest tests/engine/tp_quant_cases.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv.models.build import dequantized_model
from jaxkv.models.quant import quantize_model
from jaxkv.models.sharding import param_name
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _shards(llm) -> dict:
    return {
        param_name(p): (x.shape, x.dtype, x.addressable_shards[0].data.shape)
        for p, x in jax.tree_util.tree_leaves_with_path(llm.llm_engine.runner.state)
    }


@pytest.mark.parametrize("block", [None, 32])
def test_int8_two_devices_equal_one(block):
    """int8 (per channel, or blocks of 32 inputs) on 2 devices: the tokens of 1 device and of
    the dense forward on the dequantized weights; every scale split with its kernel."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 37, 12)]
    outs = {}
    for tp in (1, 2):
        model = quantize_model(small_model("tiny-llama"), "int8", block)
        llm = make_llm(model, tensor_parallel_size=tp)
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert_no_block_leaks(llm)
    assert outs[2] == outs[1]
    ref = dequantized_model(model)
    assert outs[1] == [dense_greedy(ref, p, 8) for p in prompts]
    shards = _shards(llm)
    assert shards["model.layers.0.self_attn.q_proj.kernel"] == ((128, 128), np.int8, (128, 64))
    assert shards["model.layers.1.mlp.down_proj.kernel"] == ((256, 128), np.int8, (128, 128))
    assert shards["lm_head.weight"] == ((512, 128), np.int8, (256, 128))
    if block is None:
        assert shards["model.layers.0.self_attn.q_proj.scale"][::2] == ((128,), (64,))
        assert shards["model.layers.1.mlp.down_proj.scale"][::2] == ((128,), (128,))
        assert shards["lm_head.scale"][::2] == ((512,), (256,))
    else:
        assert shards["model.layers.0.self_attn.q_proj.block_scale"][::2] == ((4, 128), (4, 64))
        assert shards["model.layers.1.mlp.down_proj.block_scale"][::2] == ((8, 128), (4, 128))
        assert shards["lm_head.block_scale"][::2] == ((512, 4), (256, 4))


def test_q4_two_devices_equal_one():
    """4-bit blocks on 2 devices: the tokens of 1 device and of the dense forward on the
    dequantized weights; packed kernels, scales and offsets split alike (a row-parallel shard
    holds whole blocks of 32 inputs)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 37)]
    outs = {}
    for tp in (1, 2):
        model = quantize_model(small_model("tiny-llama"), "q4")
        llm = make_llm(model, tensor_parallel_size=tp)
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert_no_block_leaks(llm)
    assert outs[2] == outs[1]
    assert outs[1] == [dense_greedy(dequantized_model(model), p, 8) for p in prompts]
    shards = _shards(llm)
    assert shards["model.layers.0.self_attn.q_proj.kernel"] == ((64, 128), np.uint8, (64, 64))
    assert shards["model.layers.1.mlp.down_proj.kernel"] == ((128, 128), np.uint8, (64, 128))
    for leaf in ("block_scale", "block_offset"):
        q, down = (
            f"model.layers.{i}.{m}.{leaf}"
            for i, m in ((0, "self_attn.q_proj"), (1, "mlp.down_proj"))
        )
        assert shards[q] == ((4, 128), np.float16, (4, 64))
        assert shards[down] == ((8, 128), np.float16, (4, 128))
    assert shards["lm_head.weight"] == ((512, 64), np.uint8, (256, 64))


def test_loaded_by_name_on_two_devices():
    """``quantization="int8"`` through the engine's config: the worker builds the quantized
    model straight onto the mesh (a jitted init), the same weights as one device's."""
    prompt = list(range(3, 20))
    outs = {}
    for tp in (1, 2):
        llm = make_llm(
            "tiny-llama", quantization="int8", tensor_parallel_size=tp, max_model_len=256
        )
        assert llm.llm_engine.config.quantization == "int8"
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        outs[tp] = out.outputs[0].token_ids
    assert outs[2] == outs[1]
    shards = _shards(llm)
    assert shards["model.layers.0.mlp.gate_proj.kernel"] == ((512, 1408), np.int8, (512, 704))
    assert shards["model.layers.0.mlp.gate_proj.scale"][::2] == ((1408,), (704,))
