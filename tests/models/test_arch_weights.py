"""HF weight mapping: names, layouts, round trip, and the errors a bad checkpoint gets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import build_model, dense_forward, get_config, hf_state_dict, load_hf_weights

_SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def _config(name: str, **kw):
    return get_config(name, **{**_SMALL, **kw})


def _ids():
    return jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 9)), jnp.int32)


def test_llama_hf_names_and_layouts():
    sd = hf_state_dict(build_model(_config("tiny-llama", qk_norm=True, attention_bias=True)))
    assert sd["model.embed_tokens.weight"].shape == (128, 32)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)  # [out, in]
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)
    assert sd["model.layers.1.self_attn.k_proj.bias"].shape == (16,)
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (8,)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (32, 48)
    assert sd["lm_head.weight"].shape == (128, 32)
    assert "model.layers.0.self_attn.o_proj.bias" not in sd  # attention_out_bias is separate
    assert {k for k in sd if "layernorm" in k} == {
        f"model.layers.{i}.{n}.weight"
        for i in range(2)
        for n in ("input_layernorm", "post_attention_layernorm")
    }
    assert len(sd) == 2 + 1 + 2 * (4 + 3 + 3 + 2 + 2)  # embed, head, norm; per layer


def test_gemma2_hf_names():
    sd = hf_state_dict(build_model(_config("tiny-hybrid")))
    assert "lm_head.weight" not in sd  # tied
    assert {k.split(".", 3)[3] for k in sd if k.startswith("model.layers.1.")} == {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
    }


@pytest.mark.parametrize(
    "name, kw",
    [
        ("tiny-llama", dict(attention_bias=True, qk_norm=True)),
        ("tiny-hybrid", dict(sliding_window=4)),
    ],
)
def test_round_trip_gives_identical_outputs(name, kw):
    config = _config(name, **kw)
    src = build_model(config, seed=1)
    sd = hf_state_dict(src)
    rng = np.random.RandomState(0)
    sd = {
        k: v + 0.05 * rng.randn(*v.shape).astype(v.dtype) for k, v in sd.items()
    }  # non-trivial norms
    src = load_hf_weights(src, sd)
    dst = load_hf_weights(build_model(config, seed=2), hf_state_dict(src))
    for k, v in hf_state_dict(dst).items():
        np.testing.assert_array_equal(v, sd[k], err_msg=k)
    np.testing.assert_array_equal(
        np.asarray(nnx.jit(dense_forward)(src, _ids())),
        np.asarray(nnx.jit(dense_forward)(dst, _ids())),
    )


def test_load_casts_to_config_dtype():
    config = _config("tiny-llama", dtype="bfloat16")
    sd = {k: v.astype(np.float32) for k, v in hf_state_dict(build_model(config)).items()}
    model = load_hf_weights(build_model(config, seed=3), sd)
    assert model.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    logits = nnx.jit(dense_forward)(model, _ids())
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_missing_unexpected_and_shape_errors_are_all_named():
    model = build_model(_config("tiny-llama"))
    sd = hf_state_dict(model)
    del sd["model.layers.1.mlp.up_proj.weight"], sd["model.norm.weight"]
    sd["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
    sd["model.layers.0.self_attn.q_proj.weight"] = np.zeros((32, 31), np.float32)
    before = np.asarray(model.model.layers[0].self_attn.q_proj.kernel[...])
    with pytest.raises(ValueError) as e:
        load_hf_weights(model, sd)
    msg = str(e.value)
    for needle in (
        "missing tensors (2)",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "unexpected tensors (1)",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight: got (32, 31), expected (32, 32)",
    ):
        assert needle in msg, (needle, msg)
    np.testing.assert_array_equal(before, model.model.layers[0].self_attn.q_proj.kernel[...])


def test_skips_buffers_and_tied_lm_head():
    model = build_model(_config("tiny-hybrid"))
    sd = hf_state_dict(model)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied checkpoints may store it
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    load_hf_weights(model, sd)
    untied = build_model(_config("tiny-llama"))
    sd = hf_state_dict(untied)
    del sd["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_hf_weights(untied, sd)


def test_init_is_deterministic_and_seeded():
    config = _config("tiny-llama")
    a, b, c = (hf_state_dict(build_model(config, seed=s)) for s in (0, 0, 1))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_abstract_build_then_load():
    config = _config("tiny-hybrid")
    src = build_model(config, seed=1)
    model = build_model(config, abstract=True)  # nothing allocated until load_hf_weights
    assert isinstance(model.model.norm.weight.get_value(), jax.ShapeDtypeStruct)
    load_hf_weights(model, hf_state_dict(src))
    np.testing.assert_array_equal(
        np.asarray(nnx.jit(dense_forward)(model, _ids())),
        np.asarray(nnx.jit(dense_forward)(src, _ids())),
    )
