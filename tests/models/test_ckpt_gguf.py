"""GGUF files written the way llama.cpp's converter writes them, loaded back by load_model."""

import sys
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_fixtures import gguf_permute_rows, hf_config_dict, small_config, write_llama_gguf

from jaxkv.models import build_model, dense_forward, hf_state_dict
from jaxkv.models.checkpoint import read_gguf
from jaxkv.models.checkpoint.gguf_names import gguf_to_hf_name, unpermute_rotary_rows
from jaxkv.models.registry import load_model

IDS = jnp.asarray([[1, 5, 9, 200, 3, 77, 12, 8]], dtype=jnp.int32)  # [1, L]
Q = gguf.GGMLQuantizationType


def test_unpermute_undoes_the_converter_rows():
    # One head, head_dim 4: HF rows [a, b, c, d] are stored as [a, c, b, d].
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    np.testing.assert_array_equal(unpermute_rotary_rows(stored, 1).ravel(), [0, 1, 2, 3])
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads, head_dim 8
    np.testing.assert_array_equal(unpermute_rotary_rows(gguf_permute_rows(w, 3), 3), w)
    assert gguf_to_hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_conv"):
        gguf_to_hf_name("blk.0.ssm_conv.weight")


@pytest.mark.parametrize("tied", [True, False])
def test_f32_gguf_loads_back_exactly(tmp_path, tied):
    config = small_config(tie_word_embeddings=tied)
    model = build_model(config, seed=5)
    tensors = hf_state_dict(model)
    write_llama_gguf(tmp_path / "m.gguf", hf_config_dict(config), tensors)

    hf_config, back, tokenizer, template = read_gguf(tmp_path / "m.gguf")
    assert hf_config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in back) is (not tied)
    assert set(back) == set(tensors)
    for name, value in tensors.items():  # q/k permutation undone exactly
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    assert tokenizer is not None and template is not None

    loaded, loaded_config, _ = load_model(tmp_path / "m.gguf")
    for field in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert getattr(loaded_config, field) == getattr(config, field), field
    assert loaded_config.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    np.testing.assert_allclose(
        np.asarray(dense_forward(loaded, IDS)),
        np.asarray(dense_forward(model, IDS)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_quantized_gguf_logits_close(tmp_path):
    config = small_config()
    model = build_model(config, seed=6)
    tensors = hf_state_dict(model)
    quantize = {
        "model.layers.0.self_attn.q_proj.weight": Q.Q8_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q8_0,
        "model.layers.1.mlp.up_proj.weight": Q.Q8_0,
        "model.layers.1.mlp.down_proj.weight": Q.F16,
        "model.layers.1.self_attn.v_proj.weight": Q.Q4_0,
        "model.layers.1.self_attn.o_proj.weight": Q.Q4_1,
    }
    write_llama_gguf(tmp_path / "q.gguf", hf_config_dict(config), tensors, quantize=quantize)
    _, back, _, _ = read_gguf(tmp_path / "q.gguf")
    for name, qtype in quantize.items():  # each dequantized tensor is near its original
        tol = {Q.Q8_0: 0.02, Q.F16: 1e-3, Q.Q4_0: 0.3, Q.Q4_1: 0.3}[qtype]
        assert np.abs(back[name] - tensors[name]).max() < tol * np.abs(tensors[name]).max(), name

    loaded, _, _ = load_model(tmp_path / "q.gguf")
    want = np.asarray(dense_forward(model, IDS))
    got = np.asarray(dense_forward(loaded, IDS))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


def test_gguf_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'mamba' is not supported"):
        read_gguf(tmp_path / "mamba.gguf")


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q8_0])
def test_k_quant_tensors_dequantize_in_hf_layout(tmp_path, qtype):
    """K-quant tensors (blocks of 256 along a row) read back as ``[rows, cols]`` in HF order,
    block for block what gguf-py dequantizes (random block bytes: the layout is the test)."""
    from jaxkv.models.checkpoint.gguf_reader import dequantize_tensor

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * 256
    raw = np.random.default_rng(int(qtype)).integers(
        0, 256, size=(rows, cols // block * nbytes), dtype=np.uint8
    )
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    with np.errstate(invalid="ignore", over="ignore"):  # random f16 scales include NaN / inf
        got = dequantize_tensor(tensor)
        want = gguf.quants.dequantize(raw, qtype)  # row by row: each row its own blocks
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(got, want.reshape(rows, cols))
