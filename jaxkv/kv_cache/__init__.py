"""KV-cache specs and configuration, shared by the host core and the worker (no jax import)."""
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
