"""Turn a model's per-layer attention facts into KV-cache specs (the engine owns block size and dtype)."""

from __future__ import annotations

from collections.abc import Mapping

from jaxkv.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


def kv_cache_specs_from_layers(
    layer_infos: Mapping[str, object], *, block_size: int, cache_dtype: str
) -> dict[str, KVCacheSpec]:
    """``layer_infos``: layer name -> object with ``num_kv_heads``, ``head_size`` and
    ``sliding_window`` (None for full attention), e.g. ``jaxkv.models.LayerKVInfo``."""
    specs: dict[str, KVCacheSpec] = {}
    for name, info in layer_infos.items():
        common = dict(
            block_size=block_size,
            num_kv_heads=info.num_kv_heads,
            head_size=info.head_size,
            dtype=cache_dtype,
        )
        if info.sliding_window is None:
            specs[name] = FullAttentionSpec(**common)
        else:
            specs[name] = SlidingWindowSpec(**common, sliding_window=info.sliding_window)
    return specs
