"""KV-cache page layout: the typed, page-major view of a flat uint8 KV buffer.

A KV buffer is one flat ``uint8`` array of ``num_blocks * page_bytes`` bytes. Block ``b`` is
the contiguous byte range ``[b * page_bytes, (b + 1) * page_bytes)`` so the worker can zero,
copy or transfer a block as one slice. Inside a page the order is ``[2, Hkv, bs, D]``:

    kv_cache[N, 2, Hkv, bs, D]     kv_cache[b, 0, h] = K of block b, KV head h: one [bs, D] tile
                                   kv_cache[b, 1, h] = V of block b, KV head h

Why this in-page order: the unit every kernel loads is "the K (or V) rows of one block for one
KV head" -- a [bs, D] tile that feeds one ``dot`` per KV head (a Triton program and a Mosaic
kernel both process all query heads of one KV head together). With ``[2, Hkv, bs, D]`` that tile
is one contiguous ``bs * D * itemsize`` byte run (a single coalesced load / one DMA), and the K
and V tiles of the same head sit at a fixed stride. Token-major orders (``[bs, Hkv, D]``) would
make each tile ``bs`` strided runs of ``D`` elements.

Dtypes: "float32" | "bfloat16" | "float16" | "fp8" (float8_e4m3fn, 1 byte), or the jnp dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: Canonical KV dtype names -> jnp dtypes. Aliases below map onto these names.
KV_DTYPES: dict[str, jnp.dtype] = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
}
_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float8_e4m3fn": "fp8",
    "fp8_e4m3": "fp8",
}


def resolve_kv_dtype(dtype) -> jnp.dtype:
    """Returns the jnp dtype for a KV dtype name ("bfloat16", "fp8", ...) or a jnp/numpy dtype."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name not in KV_DTYPES:
            raise ValueError(
                f"unsupported KV-cache dtype {dtype!r}; expected one of {sorted(KV_DTYPES)}"
            )
        return KV_DTYPES[name]
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unsupported KV-cache dtype {dtype!r}") from e
    if dt not in KV_DTYPES.values():
        raise ValueError(
            f"unsupported KV-cache dtype {dtype!r}; expected one of {sorted(KV_DTYPES)}"
        )
    return dt


def is_fp8(dtype) -> bool:
    """True when ``dtype`` (name or dtype) is the fp8 KV dtype (float8_e4m3fn)."""
    return resolve_kv_dtype(dtype) == KV_DTYPES["fp8"]


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def page_bytes(block_size: int, num_kv_heads: int, head_size: int, dtype) -> int:
    """Bytes of one page (block): K and V of ``block_size`` tokens for every KV head."""
    _check_dims(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size)
    return 2 * block_size * num_kv_heads * head_size * resolve_kv_dtype(dtype).itemsize


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype
) -> tuple[int, ...]:
    """Typed page-major shape ``(N, 2, Hkv, bs, D)`` of a KV cache (see module docstring).

    ``dtype`` only validates here (the shape does not depend on it) so callers can use one
    signature for every backend's layout.
    """
    _check_dims(
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
    )
    resolve_kv_dtype(dtype)
    return (int(num_blocks), 2, int(num_kv_heads), int(block_size), int(head_size))


def kv_cache_view(
    buffer: jax.Array,  # [N * page_bytes] uint8
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype,
) -> jax.Array:
    """Typed view ``[N, 2, Hkv, bs, D]`` of a flat uint8 KV buffer: bitcast + reshape, no copy.

    Same-width bitcasts (fp8) alias the buffer. A size-changing one (uint8 -> bf16 / f32) is
    expanded by XLA:CPU into an elementwise pass, which is free only when fused into a single
    consumer; read inside a loop or by a custom call it is materialised (a full cache copy,
    measured). Attention therefore takes :func:`kv_cache_byte_view` plus ``kv_dtype`` and
    bitcasts only the pages it gathered; this typed view is for tests and small tools.

    Example: bs 16, Hkv 8, D 128, bfloat16 -> page_bytes = 2*16*8*128*2 = 65536; a buffer of
    1048576 bytes is 16 blocks and views as [16, 2, 8, 16, 128] bfloat16.
    """
    dt = resolve_kv_dtype(dtype)
    pb = page_bytes(block_size, num_kv_heads, head_size, dt)
    if buffer.ndim != 1 or buffer.dtype != jnp.uint8:
        raise ValueError(
            f"KV buffer must be flat uint8, got shape {buffer.shape} dtype {buffer.dtype}"
        )
    if buffer.shape[0] % pb:
        raise ValueError(
            f"KV buffer of {buffer.shape[0]} bytes is not a multiple of page_bytes={pb} "
            f"(block_size={block_size}, num_kv_heads={num_kv_heads}, "
            f"head_size={head_size}, dtype={dt.name})"
        )
    shape = kv_cache_shape(buffer.shape[0] // pb, block_size, num_kv_heads, head_size, dt)
    return bytes_to_typed(buffer, dt).reshape(shape)


def kv_cache_byte_view(
    buffer: jax.Array,  # [N * page_bytes] uint8
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype,
) -> jax.Array:
    """The same pages as :func:`kv_cache_view`, still in bytes: ``[N, 2, Hkv, bs, D * itemsize]``
    uint8 (a reshape only). Pass it with ``kv_dtype=dtype`` to ``paged_attention``."""
    dt = resolve_kv_dtype(dtype)
    pb = page_bytes(block_size, num_kv_heads, head_size, dt)
    if buffer.ndim != 1 or buffer.dtype != jnp.uint8 or buffer.shape[0] % pb:
        raise ValueError(
            f"KV buffer must be flat uint8 of whole {pb}-byte pages, got shape "
            f"{buffer.shape} dtype {buffer.dtype}"
        )
    return buffer.reshape(
        buffer.shape[0] // pb, 2, num_kv_heads, block_size, head_size * dt.itemsize
    )


def typed_view_of_bytes(kv_bytes: jax.Array, dtype, *, abstract: bool = False):
    """Typed ``[N, 2, Hkv, bs, D]`` of a byte view; ``abstract=True`` gives only its
    ShapeDtypeStruct (for argument checks, no computation)."""
    dt = resolve_kv_dtype(dtype)
    if kv_bytes.dtype != jnp.uint8 or kv_bytes.ndim != 5 or kv_bytes.shape[-1] % dt.itemsize:
        raise ValueError(
            f"with kv_dtype={dt.name} kv_cache must be the uint8 byte view "
            f"[N, 2, Hkv, bs, D * {dt.itemsize}], got {kv_bytes.dtype}{list(kv_bytes.shape)}"
        )
    if abstract:
        return jax.ShapeDtypeStruct((*kv_bytes.shape[:-1], kv_bytes.shape[-1] // dt.itemsize), dt)
    return bytes_to_typed(kv_bytes, dt)


def bytes_to_typed(raw: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Bitcasts a uint8 array whose last dim is a multiple of itemsize to ``dtype`` (last dim / itemsize)."""
    isz = dtype.itemsize
    if isz == 1:
        return lax.bitcast_convert_type(raw, dtype)
    return lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], raw.shape[-1] // isz, isz), dtype)


def typed_to_bytes(x: jax.Array) -> jax.Array:
    """Bitcasts ``x [..., D]`` to uint8 ``[..., D * itemsize]`` (same memory order)."""
    b = lax.bitcast_convert_type(x, jnp.uint8)
    if x.dtype.itemsize == 1:
        return b
    return b.reshape(*x.shape[:-1], x.shape[-1] * x.dtype.itemsize)


def compute_dtype(q_dtype, cache_dtype):
    """Dtype of the dots: the cache dtype when q matches it (bf16 x bf16 -> f32 accumulation is
    faster than converting K/V to f32 on XLA:CPU); f32 when either side is f32; fp8 caches are
    widened to q's 16-bit dtype (or f32)."""
    q_dtype, cache_dtype = jnp.dtype(q_dtype), jnp.dtype(cache_dtype)
    if jnp.float32 in (q_dtype, cache_dtype):
        return jnp.dtype(jnp.float32)
    if cache_dtype == jnp.float8_e4m3fn:
        return q_dtype if q_dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)
    return cache_dtype if cache_dtype == q_dtype else jnp.dtype(jnp.float32)
