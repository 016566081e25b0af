"""Device math: paged-attention kernels, their references, and the KV-cache layout.

Imports jax only. Layout: ``kv_cache_shape`` / ``kv_cache_view`` (page-major ``[N, 2, Hkv, bs, D]``
typed view of a flat uint8 buffer); writes: ``write_kv`` (in-place byte scatter, backends "xla" |
"pallas"); attention: ``paged_attention`` (backends "reference" | "xla" | "pallas"; the pallas
backend lowers through Triton on GPU, Mosaic on TPU) and ``paged_attention_reference``.
"""

from jaxkv.pallas_kernels.attention import BACKENDS, paged_attention
from jaxkv.pallas_kernels.kv_write import write_kv
from jaxkv.pallas_kernels.layout import (
    kv_cache_byte_view,
    kv_cache_shape,
    kv_cache_view,
    page_bytes,
    resolve_kv_dtype,
)
from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID, PAD_SLOT_ID, AttentionMetadata
from jaxkv.pallas_kernels.reference import paged_attention_reference

__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "kv_cache_shape",
    "kv_cache_byte_view",
    "kv_cache_view",
    "page_bytes",
    "paged_attention",
    "paged_attention_reference",
    "resolve_kv_dtype",
    "write_kv",
]
