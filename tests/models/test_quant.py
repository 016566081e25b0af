"""Weight-only quantization (jaxkv.models.quant): round trips, the quantized linear layer,
quantized loads (HF directory, GGUF with Q8_0 blocks kept) and the partition rules of scales."""

import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import hf_config_dict, small_config, write_llama_gguf

from jaxkv.models import build_model, dense_forward, hf_state_dict
from jaxkv.models.build import dequantized_model
from jaxkv.models.checkpoint import GGUFTensors, write_safetensors_dir
from jaxkv.models.quant import (
    QuantizedLinear,
    QuantizedLMHead,
    dequantize,
    quantize_fp8,
    quantize_int8,
    quantize_model,
)
from jaxkv.models.registry import gguf_layout, load_model
from jaxkv.models.sharding import DEFAULT_TP_RULES, TP_AXIS, partition_spec

Q = gguf.GGMLQuantizationType
IDS = jnp.asarray([[1, 5, 9, 200, 3, 77, 12, 8]], dtype=jnp.int32)  # [1, L]


def _weights(shape=(96, 40), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("block", [None, 32])
def test_int8_round_trip_within_half_a_step(block):
    w = _weights()  # [in 96, out 40]
    q, scale = quantize_int8(w, block)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert scale.shape == ((40,) if block is None else (3, 40))
    assert np.abs(q).max() == 127
    back = dequantize(q, scale)
    step = scale if block is None else np.repeat(scale, block, axis=0)  # [out] | [in, out]
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-6) + 1e-7)
    # the same numbers from jax (a jitted init) as from numpy (a host load)
    jq, jscale = jax.jit(lambda x: quantize_int8(x, block))(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(jq), q)
    np.testing.assert_array_equal(np.asarray(jscale), scale)
    np.testing.assert_array_equal(np.asarray(dequantize(jq, jscale)), back)


def test_per_block_is_finer_than_per_channel():
    w = _weights()
    w[:32] *= 10.0  # one block of inputs 10x larger: a per-channel scale wastes the others
    err = {b: np.abs(dequantize(*quantize_int8(w, b)) - w)[32:].max() for b in (None, 32)}
    assert err[32] < err[None] / 5


def test_zero_columns_and_blocks_stay_zero():
    w = _weights()
    w[:, 3] = 0.0
    w[32:64, 5] = 0.0
    for block in (None, 32):
        q, scale = quantize_int8(w, block)
        back = dequantize(q, scale)
        assert np.all(np.isfinite(back))
        assert np.all(back[:, 3] == 0) and np.all(back[32:64, 5] == 0 if block else True)


@pytest.mark.parametrize("block", [None, 32])
def test_fp8_round_trip_relative_error(block):
    w = _weights()
    q, scale = quantize_fp8(w, block)
    assert q.dtype == jnp.float8_e4m3fn
    back = dequantize(q, scale)
    step = scale if block is None else np.repeat(scale, block, axis=0)
    # e4m3: 3 mantissa bits, relative error <= 2**-4 above the subnormal range (2**-6 * scale)
    assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) * 2.0**-4, step * 2.0**-9) * 1.0001)


@pytest.mark.parametrize("mode, block", [("int8", None), ("int8", 32), ("fp8", None)])
def test_quantized_linear_is_x_times_the_dequantized_kernel(mode, block):
    linear = nnx.Linear(64, 48, use_bias=True, rngs=nnx.Rngs(0))
    linear.bias[...] = jnp.arange(48, dtype=jnp.float32) / 48
    qlin = QuantizedLinear.from_linear(linear, mode, block)
    assert qlin.kernel[...].dtype == (jnp.int8 if mode == "int8" else jnp.float8_e4m3fn)
    assert qlin.block == block
    x = jax.random.normal(jax.random.key(1), (3, 5, 64))
    kernel = dequantize(qlin.kernel[...], qlin.scales())  # [64, 48] float32
    want = x @ kernel + linear.bias[...]
    got = jax.jit(lambda m, x: m(x))(qlin, x)
    # float32 throughout: the same product, only the dot's summation order may differ
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # and near the float layer: int8 per channel within 1%, fp8 within 7% of the output scale
    ref = np.asarray(linear(x))
    tol = 0.01 if mode == "int8" else 0.07
    assert np.abs(np.asarray(got) - ref).max() < tol * np.abs(ref).max()


@pytest.mark.parametrize("tied", [False, True])
def test_built_model_quantizes_every_linear_and_the_head(tied):
    config = small_config(tie_word_embeddings=tied)
    model = build_model(config, seed=3, quantization="int8")
    float_model = build_model(config, seed=3)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    kernels = [p for p in params if p[-1] == "kernel"]
    assert len(kernels) == 7 * config.num_hidden_layers
    assert all(params[p][...].dtype == jnp.int8 for p in kernels)
    assert isinstance(model.lm_head, QuantizedLMHead)
    assert model.lm_head.weight[...].shape == (config.vocab_size, config.hidden_size)
    assert params["model", "embed_tokens", "embedding"][...].dtype == jnp.float32
    # the quantized forward equals the dense forward on the dequantized weights up to the
    # rounding of its order (per-channel scales multiply the dot's output: ~4e-6 here)
    ref = np.asarray(dense_forward(dequantized_model(model), IDS))
    np.testing.assert_allclose(
        np.asarray(dense_forward(model, IDS)), ref, rtol=0, atol=3e-5 * np.abs(ref).max()
    )
    # ...and is near the float model of the same seed
    want, got = np.asarray(dense_forward(float_model, IDS)), np.asarray(dense_forward(model, IDS))
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    # abstract builds have the same structure
    abstract = build_model(config, seed=3, quantization="int8", abstract=True)
    assert jax.tree.structure(nnx.state(abstract)) == jax.tree.structure(nnx.state(model))


def test_bad_quantization_is_refused():
    config = small_config()
    for bad in ("int4", "INT8", 8, ""):
        with pytest.raises(ValueError, match="quantization must be one of"):
            build_model(config, quantization=bad)
        with pytest.raises(ValueError, match="quantization must be one of"):
            load_model("tiny-llama", quantization=bad)


def test_hf_directory_loads_quantized_per_channel(tmp_path):
    config = small_config()
    model = build_model(config, seed=4)
    write_safetensors_dir(tmp_path, hf_config_dict(config), hf_state_dict(model))
    loaded, _, _ = load_model(tmp_path, quantization="int8")
    direct = build_model(config, seed=4, quantization="int8")  # quantized on the device
    a = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(direct, nnx.Param)))
    assert set(a) == set(b)
    for path in a:  # host (numpy) quantization equals the device (jax) one
        np.testing.assert_array_equal(np.asarray(a[path][...]), np.asarray(b[path][...]), path)
    assert loaded.model.layers[0].mlp.down_proj.scale[...].shape == (config.hidden_size,)


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_q8_0_blocks_are_kept_bit_exactly(tmp_path, tied):
    config = small_config(tie_word_embeddings=tied)
    model = build_model(config, seed=6)
    tensors = hf_state_dict(model)
    q8 = [n for n in tensors if n.endswith("proj.weight")] + ["model.embed_tokens.weight"]
    q8 += [] if tied else ["lm_head.weight"]
    q8.remove("model.layers.1.mlp.down_proj.weight")
    quantize = {n: Q.Q8_0 for n in q8}
    quantize["model.layers.1.mlp.down_proj.weight"] = Q.Q4_0  # not Q8_0: re-quantized
    write_llama_gguf(tmp_path / "q.gguf", hf_config_dict(config), tensors, quantize=quantize)

    with GGUFTensors(tmp_path / "q.gguf") as source:
        for name in q8:
            q, scale = source.read_q8_0(name)  # [out, in] int8, [out, in / 32] float16
            assert q.dtype == np.int8 and scale.shape == (q.shape[0], q.shape[1] // 32)
            assert scale.dtype == np.float16  # as stored
            want = source.read(name)  # gguf's own dequantization (q/k rows unpermuted)
            np.testing.assert_array_equal(
                np.repeat(scale.astype(np.float32), 32, axis=1) * q, want, name
            )
            np.testing.assert_array_equal(dequantize(q.T, scale.T).T, want, name)
        assert source.read_q8_0("model.layers.1.mlp.down_proj.weight") is None

    loaded, _, _ = load_model(tmp_path / "q.gguf", quantization="int8")
    floats, _, _ = load_model(tmp_path / "q.gguf")  # dequantized at load, as before
    with GGUFTensors(tmp_path / "q.gguf") as source:
        q, scale = source.read_q8_0("model.layers.0.self_attn.q_proj.weight")
    attn = loaded.model.layers[0].self_attn
    np.testing.assert_array_equal(np.asarray(attn.q_proj.kernel[...]), q.T)
    np.testing.assert_array_equal(np.asarray(attn.q_proj.block_scale[...]), scale.T)
    assert isinstance(loaded.lm_head, QuantizedLMHead) and loaded.lm_head.block == 32
    # every layer in Q8_0's form: float16 scales, 34 bytes per 32 weights (re-quantized too)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(loaded))
    scales = [x for p, x in leaves if "block_scale" in jax.tree_util.keystr(p)]
    assert len(scales) == sum(n.endswith("proj.weight") for n in tensors) + 1  # + the head
    assert {np.dtype(x.dtype) for x in scales} == {np.dtype(np.float16)}
    # jaxkv plan sees the same layout and bytes as the load (gguf_layout, no data read)
    blocks, block = gguf_layout(tmp_path / "q.gguf", "int8")
    planned = nnx.eval_shape(
        lambda: quantize_model(build_model(config, seed=0), "int8", block, blocks=blocks)
    )
    nbytes = [
        sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(m)))
        for m in (planned, loaded)
    ]
    assert nbytes[0] == nbytes[1]
    # Q8_0 tensors dequantize to the float load's values bit for bit (the tied head too)
    float_sd, quant_sd = hf_state_dict(floats), hf_state_dict(loaded)
    for name in q8:
        np.testing.assert_array_equal(quant_sd[name], float_sd[name], name)
    if tied:
        np.testing.assert_array_equal(
            np.asarray(loaded.lm_head.dequantized()), float_sd["model.embed_tokens.weight"]
        )
    down = "model.layers.1.mlp.down_proj.weight"  # Q4_0, re-quantized to int8 blocks of 32
    assert np.abs(quant_sd[down] - float_sd[down]).max() <= np.abs(float_sd[down]).max() / 253.9
    got, want = np.asarray(dense_forward(loaded, IDS)), np.asarray(dense_forward(floats, IDS))
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


@pytest.mark.parametrize(
    "name, ndim, spec",
    [
        ("model.layers.0.self_attn.q_proj.scale", 1, (TP_AXIS,)),
        ("model.layers.0.self_attn.v_proj.block_scale", 2, (None, TP_AXIS)),
        ("model.layers.0.mlp.up_proj.scale", 1, (TP_AXIS,)),
        ("model.layers.0.self_attn.o_proj.scale", 1, ()),
        ("model.layers.0.mlp.down_proj.scale", 1, ()),
        ("model.layers.0.mlp.down_proj.block_scale", 2, (TP_AXIS, None)),
        ("model.layers.0.self_attn.o_proj.block_scale", 2, (TP_AXIS, None)),
        ("lm_head.scale", 1, (TP_AXIS,)),
        ("lm_head.block_scale", 2, (TP_AXIS, None)),
    ],
)
def test_scales_split_with_their_kernels(name, ndim, spec):
    assert partition_spec(name, ndim, DEFAULT_TP_RULES) == jax.sharding.PartitionSpec(*spec)


def test_quantized_params_take_a_quarter_of_the_bytes():
    config = small_config()
    nbytes = {
        q: sum(x.nbytes for x in jax.tree.leaves(nnx.state(build_model(config, quantization=q))))
        for q in (None, "int8", "fp8")
    }
    embed = config.vocab_size * config.hidden_size * 4  # stays float32
    assert nbytes["int8"] == nbytes["fp8"]
    assert nbytes["int8"] - embed < 0.3 * (nbytes[None] - embed)
    assert QuantizedLinear is not None
