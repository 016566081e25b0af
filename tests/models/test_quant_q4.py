"""The "q4" layout (jaxkv.models.quant): the packing order, quantize / dequantize, GGUF Q4_0 /
Q4_1 / Q4_K tensors kept bit for bit (against gguf's own dequantization), the quantized layer
on both matmul routes, whole models, and the partition rules of offsets."""

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
from jaxkv.models.checkpoint import GGUFTensors, write_safetensors_dir
from jaxkv.models.quant import (
    CPU_KERNEL_MAX_ROWS,
    QuantizedLinear,
    QuantizedLMHead,
    dequantize_q4,
    pack_q4,
    quantize_q4,
    unpack_q4,
)
from jaxkv.models.registry import load_model
from jaxkv.models.sharding import DEFAULT_TP_RULES, TP_AXIS, partition_spec

Q = gguf.GGMLQuantizationType
IDS = jnp.asarray([[1, 5, 9, 200, 3, 77, 12, 8]], dtype=jnp.int32)  # [1, L]


def test_packing_order_is_gguf_block_order():
    """Byte ``16 b + j`` holds input ``32 b + j`` (low nibble) and ``32 b + 16 + j`` (high)."""
    q = np.random.default_rng(0).integers(0, 16, size=(64, 3)).astype(np.uint8)  # [in, out]
    packed = pack_q4(q)
    assert packed.shape == (32, 3) and packed.dtype == np.uint8
    for b in range(2):
        for j in range(16):
            want = q[32 * b + j] | (q[32 * b + 16 + j] << 4)
            np.testing.assert_array_equal(packed[16 * b + j], want)
    np.testing.assert_array_equal(unpack_q4(packed), q)
    np.testing.assert_array_equal(np.asarray(pack_q4(jnp.asarray(q))), packed)
    np.testing.assert_array_equal(np.asarray(unpack_q4(jnp.asarray(packed))), q)


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
def test_round_trip_within_half_a_step(scale_dtype):
    w = np.random.default_rng(1).normal(size=(96, 40)).astype(np.float32)  # [in, out]
    packed, scale, offset = quantize_q4(w, scale_dtype)
    assert packed.shape == (48, 40) and scale.shape == offset.shape == (3, 40)
    assert scale.dtype == offset.dtype == scale_dtype
    back = dequantize_q4(packed, scale, offset)
    groups = w.reshape(3, 32, 40)
    low, high = groups.min(axis=1), groups.max(axis=1)
    s = scale.astype(np.float32)
    # half a step, plus what rounding the scale and the offset to scale_dtype moves
    bound = 0.5 * s + np.abs(offset - low) + 15 * np.abs(s - (high - low) / 15) + 1e-6
    err = np.abs(back - w).reshape(3, 32, 40).max(axis=1)
    assert (err <= bound).all()
    assert err.max() > 0.1 * s.max()  # 4 bits: the error is a visible fraction of a step


def test_zero_blocks_stay_zero_and_jax_equals_numpy():
    w = np.random.default_rng(2).normal(size=(64, 8)).astype(np.float32)
    w[:32, 3] = 0.0  # one all-zero block
    packed, scale, offset = quantize_q4(w)
    assert scale[0, 3] == 0 and offset[0, 3] == 0
    np.testing.assert_array_equal(dequantize_q4(packed, scale, offset)[:32, 3], 0.0)
    # a device init (jax) and a host load (numpy) quantize the same float weights alike
    for got, want in zip(jax.jit(quantize_q4)(jnp.asarray(w)), (packed, scale, offset)):
        np.testing.assert_array_equal(np.asarray(got), want)


def _q4_k_rows(rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K rows ``[rows, cols / 256 * 144]`` uint8 (gguf-py cannot quantize to Q4_K):
    random 6-bit scales, minimums and nibbles under small float16 ``d`` / ``dmin``."""
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 1)).astype(np.float16)
    dmin = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 1)).astype(np.float16)
    raw[..., 0:2] = d.view(np.uint8)
    raw[..., 2:4] = dmin.view(np.uint8)
    return raw.reshape(rows, -1)


#: GGUF types of the test file's tensors (HF names below "model.layers.{i}."); others F32
LAYER_TYPES = {
    "self_attn.q_proj": Q.Q4_0,  # permuted rows
    "self_attn.k_proj": Q.Q4_1,  # permuted rows
    "self_attn.v_proj": Q.Q4_K,
    "self_attn.o_proj": Q.Q8_0,  # stays int8, as stored
    "mlp.gate_proj": Q.Q4_K,
    "mlp.up_proj": Q.Q4_1,
    "mlp.down_proj": Q.Q6_K if hasattr(Q, "Q6_K") else Q.Q8_0,  # over 4 bits: int8 blocks
}


def _write_q4_gguf(path, tied: bool):
    """A 2-layer llama GGUF (hidden 256: Q4_K's 256-value super-blocks fit) mixing the types
    of ``LAYER_TYPES``, a Q8_0 embedding and, untied, a Q4_K head."""
    config = small_config(
        hidden_size=256, intermediate_size=256, head_dim=64, tie_word_embeddings=tied
    )
    tensors = hf_state_dict(build_model(config, seed=7))
    rng = np.random.default_rng(3)
    quantize, raw = {"model.embed_tokens.weight": Q.Q8_0}, {}
    for name, value in tensors.items():
        kind = ".".join(name.split(".")[3:5])
        qtype = LAYER_TYPES.get(kind, Q.Q4_K if name == "lm_head.weight" else None)
        if qtype == Q.Q4_K:
            raw[name] = (qtype, _q4_k_rows(*value.shape, rng))
        elif qtype == getattr(Q, "Q6_K", None):  # gguf-py cannot quantize to Q6_K either
            quantize[name] = Q.Q8_0
        elif qtype is not None:
            quantize[name] = qtype
    write_llama_gguf(path, hf_config_dict(config), tensors, quantize=quantize, raw=raw)
    return config


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_q4_tensors_are_kept_bit_exactly(tmp_path, tied):
    _write_q4_gguf(tmp_path / "q.gguf", tied)
    q4_names = [
        f"model.layers.{i}.{kind}.weight"
        for i in range(2)
        for kind, qtype in LAYER_TYPES.items()
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K)
    ] + ([] if tied else ["lm_head.weight"])
    with GGUFTensors(tmp_path / "q.gguf") as source:
        for name in q4_names:
            packed, scale, offset = source.read_q4(name)  # HF layout, rows unpermuted
            want = source.read(name)  # gguf's own dequantization
            assert packed.shape == (want.shape[0], want.shape[1] // 2), name
            k_quant = "v_proj" in name or "gate_proj" in name or "lm_head" in name
            assert scale.dtype == (np.float32 if k_quant else np.float16), name
            np.testing.assert_array_equal(dequantize_q4(packed.T, scale.T, offset.T).T, want)
        packed, scale, offset = source.read_q4("model.layers.0.mlp.gate_proj.weight")
        assert source.read_q4("model.layers.0.self_attn.o_proj.weight") is None  # Q8_0
    # the gate (rows not permuted) against gguf.quants on the file's own bytes
    (gate,) = [
        t for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors if t.name == "blk.0.ffn_gate.weight"
    ]
    direct = gguf.quants.dequantize(gate.data, Q.Q4_K).reshape(256, 256)
    np.testing.assert_array_equal(dequantize_q4(packed.T, scale.T, offset.T).T, direct)

    loaded, _, _ = load_model(tmp_path / "q.gguf", quantization="q4")
    floats, _, _ = load_model(tmp_path / "q.gguf")  # dequantized at load
    layer = loaded.model.layers[0]
    assert layer.self_attn.q_proj.mode == "q4" and layer.self_attn.q_proj.kernel.dtype == np.uint8
    assert layer.self_attn.v_proj.block_scale.dtype == np.float32  # Q4_K
    assert layer.mlp.up_proj.block_scale.dtype == np.float16  # Q4_1
    assert (layer.self_attn.o_proj.mode, layer.self_attn.o_proj.block) == ("int8", 32)
    assert (layer.mlp.down_proj.mode, layer.mlp.down_proj.block) == ("int8", 32)
    head = loaded.lm_head
    assert isinstance(head, QuantizedLMHead)
    assert (head.mode, head.block) == (("int8", 32) if tied else ("q4", 32))
    float_sd, quant_sd = hf_state_dict(floats), hf_state_dict(loaded)
    for name in q4_names + ["model.layers.1.self_attn.o_proj.weight"]:
        np.testing.assert_array_equal(quant_sd[name], float_sd[name], name)
    got, want = np.asarray(dense_forward(loaded, IDS)), np.asarray(dense_forward(floats, IDS))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()  # same weights


@pytest.mark.parametrize("rows", [1, CPU_KERNEL_MAX_ROWS + 8])  # the CPU kernel; XLA
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_is_x_times_the_dequantized_kernel(rows, bias):
    linear = nnx.Linear(96, 72, use_bias=bias, rngs=nnx.Rngs(0))
    if bias:
        linear.bias[...] = jnp.linspace(-1, 1, 72)
    q = QuantizedLinear.from_linear(linear, "q4")
    assert q.kernel.shape == (48, 72) and q.block_offset.shape == (3, 72)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(rows, 96)), jnp.float32)
    want = x @ q.dequantized() + (linear.bias[...] if bias else 0)
    got = jax.jit(lambda x: q(x))(x)
    tol = 2e-6 * float((jnp.abs(x) @ jnp.abs(q.dequantized())).max())  # summation order
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol)
    # ... and not the float kernel's product: 4 bits move it
    assert np.abs(np.asarray(got) - np.asarray(linear(x))).max() > 1e-3


@pytest.mark.parametrize("rows", [1, CPU_KERNEL_MAX_ROWS + 8])
def test_q4_head_logits_are_the_dequantized_heads(rows):
    weight = jnp.asarray(np.random.default_rng(5).normal(size=(80, 64)), jnp.float32)
    head = QuantizedLMHead.from_weight(weight, "q4")
    assert head.weight.shape == (80, 32) and head.block_offset.shape == (80, 2)
    hidden = jnp.asarray(np.random.default_rng(6).normal(size=(rows, 64)), jnp.float32)
    got = jax.jit(lambda h: head.logits(h))(hidden)
    want = hidden @ head.dequantized().T
    tol = 2e-6 * float((jnp.abs(hidden) @ jnp.abs(head.dequantized()).T).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol)


def test_built_model_is_q4_and_a_float_checkpoint_loads_the_same(tmp_path):
    """build_model(quantization="q4") quantizes on the device; an HF directory of the same
    float weights loads through the host's numpy quantization to the same bits."""
    config = small_config()
    model = build_model(config, seed=4, quantization="q4")
    qmods = [m for _, m in nnx.iter_graph(model) if isinstance(m, QuantizedLinear)]
    assert len(qmods) == 7 * config.num_hidden_layers and all(m.mode == "q4" for m in qmods)
    assert model.lm_head.mode == "q4"
    write_safetensors_dir(
        tmp_path, hf_config_dict(config), hf_state_dict(build_model(config, seed=4))
    )
    loaded, _, _ = load_model(tmp_path, quantization="q4")
    a = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    b = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path][...]), np.asarray(b[path][...]), path)
    nbytes = {
        q: sum(x.nbytes for x in jax.tree.leaves(nnx.state(build_model(config, quantization=q))))
        for q in ("int8", "q4")
    }
    embed = config.vocab_size * config.hidden_size * 4  # stays float32
    # 4 bits and two float16 per 32 weights (0.625 B) against 1 B and float32 scales
    assert nbytes["q4"] - embed < 0.66 * (nbytes["int8"] - embed)


def test_bad_q4_layouts_are_refused():
    linear = nnx.Linear(40, 8, rngs=nnx.Rngs(0))  # 40 inputs: no blocks of 32
    with pytest.raises(ValueError, match="q4 needs a multiple of 32 inputs"):
        QuantizedLinear.from_linear(linear, "q4")
    packed, scale, offset = quantize_q4(np.ones((64, 8), np.float32))
    with pytest.raises(ValueError, match="an offset goes with mode 'q4' only"):
        QuantizedLinear(packed, scale, mode="int8", offset=offset)
    with pytest.raises(ValueError, match="offset .* does not match scale"):
        QuantizedLinear(packed, scale, mode="q4", offset=offset[:1])


@pytest.mark.parametrize(
    "name, spec",
    [
        ("model.layers.0.self_attn.q_proj.block_offset", (None, TP_AXIS)),
        ("model.layers.0.mlp.down_proj.block_offset", (TP_AXIS, None)),
        ("lm_head.block_offset", (TP_AXIS, None)),
    ],
)
def test_offsets_split_with_their_scales(name, spec):
    assert partition_spec(name, 2, DEFAULT_TP_RULES) == jax.sharding.PartitionSpec(*spec)
