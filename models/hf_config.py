"""HF ``config.json`` dict -> ``ModelConfig`` (model_type llama, mistral, qwen2, qwen3, gemma2,
gemma3_text; gemma3's ``text_config``).

Every field value that would change the math and that the models do not implement is a
ValueError naming it (rope type "yarn", hidden_act "gelu", mlp_bias, quantization, ...), so a
checkpoint never loads into a silently different model. A ``quantization_config`` of fp8
weights (``checkpoint.fp8_checkpoint.fp8_scheme``) is accepted: the architecture is the float
model's, and the loader keeps the weights fp8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxkv.models.checkpoint.fp8_checkpoint import fp8_scheme
from jaxkv.models.config import HIDDEN_ACTS, ModelConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3")
_GEMMA = ("gemma2", "gemma3_text")

# HF defaults that differ by model_type (PretrainedConfig subclasses' __init__ defaults).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
    ),
    "mistral": dict(
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096 * 32,
        sliding_window=4096,
    ),
    "qwen2": dict(
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "qwen3": dict(
        hidden_act="silu",
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "gemma2": dict(
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    # transformers' Gemma3TextConfig
    "gemma3_text": dict(
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        sliding_window_pattern=6,
    ),
}


def _require(d: Mapping[str, Any], *names: str) -> None:
    missing = [n for n in names if d.get(n) is None]
    if missing:
        raise ValueError(f"HF config (model_type {d.get('model_type')!r}) is missing {missing}")


def _rope(d: Mapping[str, Any], default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_theta``/``rope_scaling`` or transformers-5 ``rope_parameters``."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta", default_theta)
    if isinstance(params, Mapping) and "full_attention" in params:  # per layer type (Gemma 3)
        params = params["full_attention"]
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = params
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"unsupported partial_rotary_factor={d['partial_rotary_factor']} (only 1.0)"
        )
    if scaling is None:
        return float(theta if theta is not None else 10000.0), None
    rs = RopeScaling.from_dict(scaling)  # raises on "yarn", "dynamic", "longrope", ...
    return float(theta if theta is not None else 10000.0), (
        None if rs.rope_type == "default" else rs
    )


def _sliding(
    d: Mapping[str, Any], model_type: str, n: int
) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) following each HF config class's convention."""
    window = d.get("sliding_window", _DEFAULTS[model_type].get("sliding_window"))
    explicit = d.get("layer_types")
    if model_type in ("qwen2", "qwen3"):
        # HF: the window only exists when use_sliding_window; then layers >= max_window_layers slide.
        if not d.get("use_sliding_window", False):
            window = None
        if explicit is None and window is not None:
            first = d.get("max_window_layers", n)
            explicit = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if model_type == "llama":
        window = None
    if model_type == "gemma3_text" and explicit is None:
        pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
        explicit = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    if explicit is not None:
        explicit = tuple(explicit)
        if window is None:  # HF drops the window when unused; every layer is then full attention
            explicit = (
                tuple("full_attention" for _ in explicit) if model_type not in _GEMMA else explicit
            )
    return (int(window) if window is not None else None), explicit


def config_from_hf(d: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """A ``ModelConfig`` from an HF ``config.json`` dict (model_type llama / mistral / qwen2 /
    qwen3 / gemma2 / gemma3_text; ``gemma3`` reads its ``text_config``).

    Raises ValueError naming any model_type or field value this package does not support
    (a ``quantization_config`` other than fp8 weights among them).
    """
    fp8_scheme(d)  # ValueError naming a quantization jaxkv does not load (gemma3's: top level)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if model_type == "gemma3":  # the multimodal config: its language model's
        if not isinstance(d.get("text_config"), Mapping):
            raise ValueError("a gemma3 config needs its text_config (the language model's config)")
        d = {**d["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    _require(
        d,
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    defaults = _DEFAULTS[model_type]
    if d.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True (gate/up/down projections have no bias)")
    act = d.get("hidden_activation") if model_type in _GEMMA else None
    act = act or d.get("hidden_act") or defaults["hidden_act"]
    if act not in HIDDEN_ACTS:
        raise ValueError(
            f"unsupported hidden_act {act!r} for model_type {model_type!r}; "
            f"supported: {HIDDEN_ACTS}"
        )
    expected_act = defaults["hidden_act"]
    if act != expected_act:
        raise ValueError(
            f"unsupported hidden_act {act!r} for model_type {model_type!r} "
            f"(its architecture uses {expected_act!r})"
        )

    n = int(d["num_hidden_layers"])
    heads = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
    theta, scaling = _rope(d, defaults.get("rope_theta", 10000.0))
    window, layer_types = _sliding(d, model_type, n)

    bias = bool(d.get("attention_bias", False))
    out_bias = bias
    if model_type == "qwen2":  # Qwen2 hard-codes bias on q/k/v and none on o_proj
        bias, out_bias = True, False

    kw: dict[str, Any] = dict(
        architecture={"gemma2": "gemma2", "gemma3_text": "gemma3"}.get(model_type, "llama"),
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(
            d.get("max_position_embeddings", defaults["max_position_embeddings"])
        ),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        attention_bias=bias,
        attention_out_bias=out_bias,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=window,
        layer_types=layer_types,
        hidden_act=act,
        dtype=dtype,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )
    if model_type in _GEMMA:
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = d.get(name, defaults[name])
            kw[name] = float(value) if value is not None else None
    if model_type == "gemma3_text":
        local = d.get("rope_local_base_freq", defaults["rope_local_base_freq"])
        params = d.get("rope_parameters")
        if isinstance(params, Mapping) and isinstance(params.get("sliding_attention"), Mapping):
            sliding = params["sliding_attention"]
            if sliding.get("rope_type", "default") != "default":
                raise ValueError(
                    f"unsupported RoPE scaling on gemma3's sliding layers: {dict(sliding)}"
                )
            local = sliding.get("rope_theta", local)
        kw["rope_local_base_freq"] = float(local)
    return ModelConfig(**kw)
