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

TPU word layout (:func:`kv_cache_word_view`). On a TPU every array has a tiled layout that
depends on its element width (32-bit: 8 x 128 tiles; 16-bit values are packed two rows to a
32-bit word, 8-bit four), so a uint8 buffer viewed as bf16 pages is a relayout (a copy of the
cache), not a view. The word layout keeps one flat buffer of ``uint32`` words and stores each
(page, K|V, head, 128-lane chunk) as the TPU's own packed tile: ``[bs / pack, 128]`` words, row
``s`` holding typed rows ``s * pack + i`` (``i = 0`` in the low bits), ``pack = 4 / itemsize``.
The view ``[N, 2, Hkv, D / 128, bs / pack, 128]`` of the flat words is then the same bytes under
TPU tiling (a bitcast, checked on compiled TPU executables) whenever ``bs / pack`` is a multiple
of 8; the Mosaic kernels DMA word tiles and unpack them in VMEM (``pltpu.bitcast``). Pages stay
whole contiguous byte ranges (block copies, zeroing and transfers are unchanged); only the order
inside a page differs from the byte layout above.
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


#: Lanes of a TPU vector register / a word-layout row.
WORD_LANES = 128
#: Word rows of one TPU (8, 128) 32-bit tile.
WORD_SUBLANES = 8


def word_packing(dtype) -> int:
    """KV values per 32-bit word: 1 (float32), 2 (bfloat16, float16), 4 (fp8)."""
    return 4 // resolve_kv_dtype(dtype).itemsize


def check_word_layout(*, block_size: int, head_size: int, dtype) -> None:
    """Raises ValueError unless the word view of these pages is free under TPU tiling:
    ``head_size`` a multiple of 128 and ``block_size / pack`` a multiple of 8 (block_size a
    multiple of 8 for float32, 16 for 16-bit caches, 32 for fp8)."""
    _check_dims(block_size=block_size, head_size=head_size)
    pack = word_packing(dtype)
    if head_size % WORD_LANES:
        raise ValueError(
            f"the TPU word layout needs head_size to be a multiple of {WORD_LANES}, got {head_size}"
        )
    if block_size % (WORD_SUBLANES * pack):
        raise ValueError(
            f"the TPU word layout of a {resolve_kv_dtype(dtype).name} cache needs "
            f"block_size to be a multiple of {WORD_SUBLANES * pack} (whole packed "
            f"TPU tiles), got {block_size}"
        )


def kv_cache_words_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype
) -> tuple[int, ...]:
    """``(N, 2, Hkv, D / 128, bs / pack, 128)``: the word view of a cache (module docstring)."""
    _check_dims(num_blocks=num_blocks, num_kv_heads=num_kv_heads)
    check_word_layout(block_size=block_size, head_size=head_size, dtype=dtype)
    return (
        int(num_blocks),
        2,
        int(num_kv_heads),
        head_size // WORD_LANES,
        block_size // word_packing(dtype),
        WORD_LANES,
    )


def kv_cache_word_view(
    buffer: jax.Array,  # [N * page_bytes / 4] uint32
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype,
) -> jax.Array:
    """The word view ``[N, 2, Hkv, D / 128, bs / pack, 128]`` uint32 of a flat uint32 KV buffer:
    a reshape, free under TPU tiling (no relayout). Pass it to ``pallas_attention.paged_attention_words``
    and ``kv_write_pallas.write_kv_words``.

    Example: bs 16, Hkv 8, D 128, bfloat16 -> pack 2, page_bytes 65536 = 16384 words; a buffer
    of 262144 words is 16 blocks and views as [16, 2, 8, 1, 8, 128]: the K of block 3, head 5
    is the (8, 128) word tile [3, 0, 5, 0], whose row 2 holds tokens 4 (low half) and 5.
    """
    pb = page_bytes(block_size, num_kv_heads, head_size, dtype)
    check_word_layout(block_size=block_size, head_size=head_size, dtype=dtype)
    if buffer.ndim != 1 or buffer.dtype != jnp.uint32 or buffer.shape[0] % (pb // 4):
        raise ValueError(
            f"a word-layout KV buffer must be flat uint32 of whole {pb // 4}-word pages, "
            f"got shape {buffer.shape} dtype {buffer.dtype}"
        )
    return buffer.reshape(
        kv_cache_words_shape(
            buffer.shape[0] // (pb // 4), block_size, num_kv_heads, head_size, dtype
        )
    )


def typed_to_words(kv: jax.Array) -> jax.Array:
    """Typed pages ``[N, 2, Hkv, bs, D]`` -> their word view (the layout's definition in jnp,
    for tests and tools; the kernels do this in VMEM)."""
    n, two, hkv, bs, d = kv.shape
    pack = word_packing(kv.dtype)
    x = kv.reshape(n, two, hkv, bs // pack, pack, d // WORD_LANES, WORD_LANES)
    x = jnp.moveaxis(x, 5, 3)  # [N, 2, Hkv, C, bs / pack, pack, 128]
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{32 // pack}")).astype(jnp.uint32)
    shifts = (jnp.arange(pack, dtype=jnp.uint32) * (32 // pack))[:, None]
    return jnp.bitwise_or.reduce(bits << shifts, axis=5) if pack > 1 else bits[..., 0, :]


def words_to_typed(words: jax.Array, dtype) -> jax.Array:
    """The inverse of :func:`typed_to_words`: word view -> typed ``[N, 2, Hkv, bs, D]``."""
    dt = resolve_kv_dtype(dtype)
    pack = word_packing(dt)
    n, two, hkv, c, rows, lanes = words.shape
    bits = 32 // pack
    parts = words[..., None, :] >> (jnp.arange(pack, dtype=jnp.uint32) * bits)[:, None]
    parts = (parts & jnp.uint32((1 << bits) - 1)).astype(jnp.dtype(f"uint{bits}"))
    x = lax.bitcast_convert_type(parts, dt)  # [N, 2, Hkv, C, bs / pack, pack, 128]
    return jnp.moveaxis(x, 3, 5).reshape(n, two, hkv, rows * pack, c * lanes)


def quantize_to_cache(
    x: jax.Array,  # [..., D] model dtype
    dtype: jnp.dtype,
    scale=None,
) -> jax.Array:
    """Converts ``x`` to the cache dtype; fp8: ``clip(x / scale, finfo) -> float8_e4m3fn``."""
    if dtype == jnp.float8_e4m3fn:
        fi = jnp.finfo(dtype)
        y = x.astype(jnp.float32)
        if scale is not None:
            y = y / jnp.asarray(scale, jnp.float32)
        return jnp.clip(y, float(fi.min), float(fi.max)).astype(dtype)
    return x.astype(dtype)
