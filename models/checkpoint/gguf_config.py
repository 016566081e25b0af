"""GGUF metadata -> an HF ``config.json``-style dict.

llama.cpp keys are ``{arch}.{key}`` (``llama.block_count``, ``llama.attention.head_count``, ...).
The resulting dict uses transformers' names so ``ModelConfig.from_hf_config`` reads it like a
real config.json.
"""

from __future__ import annotations

from typing import Any

# general.architecture -> (HF model_type, HF architectures entry)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}


def _required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    return meta[key]


def gguf_config(meta: dict[str, Any], *, vocab_size: int, tied_embeddings: bool) -> dict:
    """Builds the HF config dict.

    Args:
      meta: GGUF metadata ``{key: python value}``.
      vocab_size: rows of the token embedding (the authority; the token list may be absent).
      tied_embeddings: True when the file has no separate ``output.weight``.

    Raises:
      ValueError: an architecture other than llama / qwen2 / qwen3, or a missing required key.
    """
    arch = _required(meta, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})"
        )
    model_type, hf_arch = _ARCHS[arch]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(_required(meta, f"{arch}.embedding_length"))
    heads = int(_required(meta, f"{arch}.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(_required(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": bool(tied_embeddings),
        "hidden_act": "silu",
    }
    if model_type == "qwen2":
        config["attention_bias"] = True
    if key("attention.sliding_window") is not None:
        config["sliding_window"] = int(key("attention.sliding_window"))
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported yet")
    for tok_key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if tok_key in meta:
            config[hf_key] = int(meta[tok_key])
    return config
