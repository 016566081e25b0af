"""GGUF metadata -> an HF ``config.json``-style dict.

llama.cpp keys are ``{arch}.{key}`` (``llama.block_count``, ``llama.attention.head_count``, ...).
The resulting dict uses transformers' names so ``config_from_hf`` reads it like a
real config.json.
"""

from __future__ import annotations

from typing import Any

# general.architecture -> (HF model_type, HF architectures entry)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# End-of-generation tokens a model's chat format ends a turn with, by text (llama.cpp's
# vocabulary loader treats them as end of generation the same way).
_EOG_TEXTS = ("<end_of_turn>",)
# Gemma 3 facts llama.cpp hard-codes rather than stores (llama-model.cpp, LLM_ARCH_GEMMA3):
# five local layers to one global, the local layers' RoPE base 10^4, and the attention scale
# 1 / sqrt(head_dim) (the 27B's 1 / sqrt(hidden / heads) aside: pass that checkpoint's
# query_pre_attn_scalar through its HF config instead).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0


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
      ValueError: an architecture other than llama / qwen2 / qwen3 / gemma3, or a missing
        required key.
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
    if model_type == "gemma3_text":
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=config["head_dim"],
            sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
            rope_local_base_freq=GEMMA3_ROPE_LOCAL_BASE_FREQ,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        )
        del config["hidden_act"]
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
    eog = [
        int(meta[k])
        for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in meta
    ]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eog += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
    if eog:  # every end-of-generation id stops generation, the EOS first
        first = [config["eos_token_id"]] if "eos_token_id" in config else []
        config["eos_token_id"] = list(dict.fromkeys(first + eog))
    return config
