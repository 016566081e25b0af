"""``jaxkv plan``: the KV-cache plan of a built-in model config for a memory budget, as text."""

from __future__ import annotations

from jaxkv.kv_cache import (
    KVCacheConfig,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_max_concurrency,
    kv_cache_specs_from_layers,
    num_tokens_in_cache,
)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def build_plan(layer_infos, *, block_size: int, cache_dtype: str, kv_cache_memory_bytes: int,
               max_model_len: int, max_num_batched_tokens: int) -> KVCacheConfig:
    specs = kv_cache_specs_from_layers(layer_infos, block_size=block_size, cache_dtype=cache_dtype)
    return get_kv_cache_config(specs, kv_cache_memory_bytes, max_model_len=max_model_len,
                               max_num_batched_tokens=max_num_batched_tokens)


def format_plan(config: KVCacheConfig, *, title: str, max_model_len: int,
                max_num_batched_tokens: int, budget: int) -> str:
    lines = [f"KV-cache plan for {title}", f"  budget {_mib(budget)}, max_model_len {max_model_len}, "
             f"max_num_batched_tokens {max_num_batched_tokens}"]
    lines.append(f"  groups ({len(config.kv_cache_groups)}):")
    for g, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = (f"sliding window {spec.sliding_window}" if isinstance(spec, SlidingWindowSpec)
                else "full attention")
        lines.append(
            f"    group {g}: {kind}, block_size {spec.block_size}, {spec.num_kv_heads} kv heads x "
            f"{spec.head_size}, {spec.dtype}, page {spec.page_size_bytes} B, "
            f"layers {', '.join(n.split('.')[2] if n.startswith('model.layers.') else n for n in group.layer_names)}"
        )
    total = sum(t.size for t in config.kv_cache_tensors)
    lines.append(f"  tensors ({len(config.kv_cache_tensors)}, {_mib(total)} in all):")
    for i, t in enumerate(config.kv_cache_tensors):
        lines.append(f"    tensor {i}: {_mib(t.size)}, shared by {', '.join(t.shared_by)}")
    conc = get_max_concurrency(config, max_model_len=max_model_len,
                               max_num_batched_tokens=max_num_batched_tokens)
    lines.append(f"  num_blocks {config.num_blocks} (block 0 is the null block)")
    lines.append(f"  tokens that fit: {num_tokens_in_cache(config):,} per group")
    lines.append(f"  max concurrency at {max_model_len} tokens/request: {conc:.2f}x")
    return "\n".join(lines)
