"""ModelConfig: HF config.json mapping per model_type, validation errors, KV facts, binding."""

from __future__ import annotations

import dataclasses

import pytest

from jaxkv.models import (
    KVCacheBinding,
    LayerKVInfo,
    RopeScaling,
    build_model,
    config_from_hf,
    get_config,
    layer_name,
)

_BASE = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=1,
    eos_token_id=[2, 3],
)


def _hf(model_type: str, **kw) -> dict:
    return {"model_type": model_type, **_BASE, **kw}


def test_llama3_config():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    c = config_from_hf(
        _hf("llama", rope_scaling=scaling, tie_word_embeddings=True, hidden_act="silu"),
        dtype="bfloat16",
    )
    assert (c.architecture, c.dtype, c.head_dim, c.num_key_value_heads) == (
        "llama",
        "bfloat16",
        16,
        2,
    )
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert c.rope_theta == 500000.0 and c.tie_word_embeddings
    assert not (c.attention_bias or c.attention_out_bias or c.qk_norm)
    assert c.layer_types == ("full_attention",) * 4 and c.sliding_window is None
    assert c.eos_token_id == (2, 3) and c.bos_token_id == 1
    assert c.sm_scale == pytest.approx(16**-0.5)
    hash(c)  # static part of the graphdef


def test_llama_attention_bias_sets_q_k_v_and_o():
    c = config_from_hf(
        _hf("llama", attention_bias=True, rope_scaling={"type": "linear", "factor": 2.0})
    )
    assert c.attention_bias and c.attention_out_bias
    assert c.rope_scaling.rope_type == "linear"


def test_mistral_slides_on_every_layer():
    c = config_from_hf(_hf("mistral", sliding_window=32, head_dim=32))
    assert c.sliding_window == 32 and c.head_dim == 32
    assert c.layer_types == ("sliding_attention",) * 4
    assert [c.layer_window(i) for i in range(4)] == [32] * 4
    c = config_from_hf(_hf("mistral", sliding_window=None))
    assert c.layer_types == ("full_attention",) * 4


def test_qwen2_bias_on_qkv_only_and_window_ignored_unless_enabled():
    c = config_from_hf(
        _hf("qwen2", sliding_window=4096, max_window_layers=2, use_sliding_window=False)
    )
    assert c.attention_bias and not c.attention_out_bias and not c.qk_norm
    assert c.sliding_window is None and c.layer_types == ("full_attention",) * 4
    c = config_from_hf(
        _hf("qwen2", sliding_window=64, max_window_layers=2, use_sliding_window=True)
    )
    assert c.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2


def test_qwen3_qk_norm_explicit_head_dim():
    c = config_from_hf(_hf("qwen3", head_dim=32, attention_bias=False, tie_word_embeddings=True))
    assert c.qk_norm and c.head_dim == 32 and not c.attention_bias


def test_gemma2_conventions():
    c = config_from_hf(
        _hf(
            "gemma2",
            head_dim=16,
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",
            sliding_window=128,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )
    assert c.architecture == "gemma2" and c.tie_word_embeddings  # HF Gemma2 default
    # HF Gemma 2: layer 0 local (sliding), layer 1 global, ...
    assert c.layer_types == ("sliding_attention", "full_attention") * 2
    assert [c.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.sm_scale == pytest.approx(16**-0.5) and c.hidden_act == "gelu_pytorch_tanh"
    explicit = ["full_attention", "sliding_attention"] * 2
    assert config_from_hf(_hf("gemma2", layer_types=explicit)).layer_types == tuple(explicit)


def test_transformers5_rope_parameters():
    c = config_from_hf(
        _hf(
            "llama", rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1234.0}
        )
    )
    assert c.rope_theta == 1234.0 and c.rope_scaling is None


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(model_type="gpt2"), "model_type 'gpt2'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(hidden_size=None), "hidden_size"),
    ],
)
def test_unsupported_hf_fields_are_named(change, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf({**_hf("llama"), **change})


def test_gemma2_rejects_silu():
    with pytest.raises(ValueError, match="hidden_act 'silu'"):
        config_from_hf(_hf("gemma2", hidden_activation="silu"))


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(architecture="gpt"), "architecture"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(layer_types=("full_attention",)), "layer_types must be 8"),
        (dict(layer_types=("sliding_attention",) * 8), "sliding_window is None"),
        (dict(attn_logit_softcapping=50.0), "soft-capping is a Gemma feature"),
        (dict(dtype="float64"), "dtype"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_model_config_validation(change, needle):
    with pytest.raises(ValueError, match=needle):
        get_config("tiny-llama", **change)


def test_named_tiny_configs():
    llama = get_config("tiny-llama")
    assert (
        llama.hidden_size,
        llama.num_hidden_layers,
        llama.num_attention_heads,
        llama.num_key_value_heads,
        llama.head_dim,
        llama.intermediate_size,
        llama.vocab_size,
        llama.tie_word_embeddings,
        llama.dtype,
    ) == (512, 8, 8, 2, 64, 1408, 32000, False, "float32")
    hybrid = get_config("tiny-hybrid")
    assert hybrid.architecture == "gemma2" and hybrid.num_hidden_layers == 8
    assert [hybrid.layer_window(i) for i in range(8)] == [128, None] * 4
    assert (hybrid.attn_logit_softcapping, hybrid.final_logit_softcapping) == (50.0, 30.0)
    with pytest.raises(ValueError, match="unknown config"):
        get_config("tiny-gpt")


def test_kv_layer_infos_hybrid():
    config = get_config(
        "tiny-hybrid",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    infos = build_model(config).kv_layer_infos()
    assert infos == {
        "model.layers.0.self_attn": LayerKVInfo(2, 8, 128),
        "model.layers.1.self_attn": LayerKVInfo(2, 8, None),
        "model.layers.2.self_attn": LayerKVInfo(2, 8, 128),
        "model.layers.3.self_attn": LayerKVInfo(2, 8, None),
    }


def test_kv_cache_binding():
    # The DESIGN.md seed: group 0 = full [L1, L3], group 1 = sliding [L0, L2]; tensor i shared.
    b = KVCacheBinding(
        layers=(
            (layer_name(0), 1, 0),
            (layer_name(1), 0, 0),
            (layer_name(2), 1, 1),
            (layer_name(3), 0, 1),
        ),
        block_size=16,
        cache_dtype="bfloat16",
    )
    assert b.lookup("model.layers.2.self_attn") == (1, 1)
    assert hash(b) == hash(dataclasses.replace(b))
    with pytest.raises(KeyError, match="model.layers.9.self_attn"):
        b.lookup(layer_name(9))
    with pytest.raises(ValueError, match="duplicate"):
        KVCacheBinding(layers=((layer_name(0), 0, 0), (layer_name(0), 0, 1)), block_size=16)
    with pytest.raises(ValueError, match="k_scale"):
        KVCacheBinding(layers=(), block_size=16, cache_dtype="bfloat16", k_scale=0.5)
    with pytest.raises(ValueError, match="backend"):
        KVCacheBinding(layers=(), block_size=16, backend="cuda")


def test_gemma3_config_from_hf_both_formats():
    """transformers 4's gemma3_text config (rope_theta, rope_local_base_freq,
    sliding_window_pattern) and transformers 5's (rope_parameters per layer type, layer_types)
    give the same ModelConfig; gemma3's multimodal config reads its text_config."""
    base = dict(
        model_type="gemma3_text",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=32,
        query_pre_attn_scalar=16,
    )
    old = config_from_hf(
        {**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6}
    )
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(8)]
    new = config_from_hf(
        {
            **base,
            "layer_types": types,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        }
    )
    assert old == new
    assert old.architecture == "gemma3" and old.qk_norm and old.tie_word_embeddings
    assert old.layer_types == tuple(types) and old.sliding_window == 32
    assert old.layer_rope(0) == (1e4, None) and old.layer_rope(5) == (1e6, None)
    assert old.attn_logit_softcapping is None and old.sm_scale == 16**-0.5
    multimodal = config_from_hf(
        {
            "model_type": "gemma3",
            "text_config": {k: v for k, v in base.items() if k != "model_type"},
        }
    )
    assert multimodal == config_from_hf(base)
    with pytest.raises(ValueError, match="text_config"):
        config_from_hf({"model_type": "gemma3"})


@pytest.mark.parametrize(
    "family, change, needle",
    [
        ("tiny-llama", dict(rope_local_base_freq=1e4), "rope_local_base_freq is a gemma3 feature"),
        ("tiny-hybrid", dict(qk_norm=False), "qk_norm must be True"),
        ("tiny-hybrid", dict(query_pre_attn_scalar=None), "needs query_pre_attn_scalar"),
    ],
)
def test_gemma3_config_validation(family, change, needle):
    gemma3 = (
        dict(
            architecture="gemma3",
            qk_norm=True,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
        if family == "tiny-hybrid"
        else {}
    )
    get_config(family, **gemma3)  # valid as it is
    with pytest.raises(ValueError, match=needle):
        get_config(family, **{**gemma3, **change})
