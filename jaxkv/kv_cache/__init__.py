"""KV-cache specs and configuration, shared by the host core and the worker (no jax import)."""

from jaxkv.kv_cache.config import (
    available_kv_cache_memory,
    blocks_per_request,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_config,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency,
    num_tokens_in_cache,
)
from jaxkv.kv_cache.from_model import kv_cache_specs_from_layers
from jaxkv.kv_cache.specs import (
    KV_DTYPE_BYTES,
    PAGE_ALIGN_BYTES,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    cdiv,
    normalize_kv_dtype,
)
