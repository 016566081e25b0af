"""Physical KV memory: one flat buffer per ``KVCacheTensor``.

Block ``b`` of a buffer is the contiguous byte range ``[b * page_bytes, (b + 1) * page_bytes)``
(``pallas_kernels`` lays every page out inside that range), so zeroing, reading or moving a
block is one contiguous slice whatever the attention layout. All ops here are functional and
meant to run under ``jax.jit`` with the buffer donated, so XLA updates it in place.

Two layouts (``KV_LAYOUTS``), told apart by the buffer's element type:

* ``"bytes"`` (CPU, GPU, and TPU shapes the word layout refuses): flat ``uint8``; per-layer
  views are ``jaxkv.pallas_kernels.kv_cache_byte_view`` (a reshape) and the backends bitcast
  what they read.
* ``"words"`` (TPU with the Mosaic kernels, ``backends.resolve_kv_layout``): flat ``uint32``,
  each page stored as the TPU's packed (8, 128) word tiles (``layout.kv_cache_word_view``), so
  the per-layer view is free under TPU tiling (a uint8 buffer viewed as bf16 is a relayout
  there). Page ops here reshape a buffer to ``[N, page_words / 1024, 8, 128]``: whole tiles,
  the same order as the flat words, so no relayout either. Connectors still see pages as
  ``page_bytes`` uint8 rows (:func:`read_blocks` / :func:`write_blocks` bitcast the pages they
  move, never the cache); their byte order is the word layout's, not the byte layout's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.kv_cache import PAGE_ALIGN_BYTES, KVCacheConfig
from jaxkv.models.sharding import TP_AXIS

#: KV buffer layouts -> the buffer's element type (module docstring).
KV_LAYOUTS = {"bytes": jnp.dtype(jnp.uint8), "words": jnp.dtype(jnp.uint32)}
#: Words of one TPU (8, 128) 32-bit tile: the unit a word-layout page is reshaped into.
_TILE_WORDS = 8 * 128


def buffer_dtype(layout: str) -> jnp.dtype:
    """The element type of a ``layout`` ("bytes" | "words") buffer; ValueError otherwise."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv layout must be one of {tuple(KV_LAYOUTS)}, got {layout!r}")
    return KV_LAYOUTS[layout]


def layout_of(buffer) -> str:
    """ "bytes" | "words": the layout a KV buffer (array or ShapeDtypeStruct) is in."""
    for name, dt in KV_LAYOUTS.items():
        if buffer.dtype == dt:
            return name
    raise ValueError(f"a KV buffer must be uint8 (bytes) or uint32 (words), got {buffer.dtype}")


def page_size_bytes(config: KVCacheConfig) -> int:
    """The uniform page size of the config's groups."""
    sizes = {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}
    if len(sizes) != 1:
        raise ValueError(f"expected one page size across groups, got {sorted(sizes)}")
    return sizes.pop()


def check_page_alignment(config: KVCacheConfig) -> None:
    """Raises ValueError if a page is not a multiple of PAGE_ALIGN_BYTES bytes."""
    for g in config.kv_cache_groups:
        page = g.kv_cache_spec.page_size_bytes
        if page % PAGE_ALIGN_BYTES:
            raise ValueError(
                f"page_size_bytes={page} of {g.kv_cache_spec} is not a multiple of "
                f"{PAGE_ALIGN_BYTES}: pages would be misaligned; raise block_size"
            )


def allocate_kv_buffers(
    config: KVCacheConfig, *, mesh=None, layout: str = "bytes"
) -> tuple[jax.Array, ...]:
    """Zero-filled flat buffers, one per tensor: ``[num_blocks * page_bytes]`` uint8 each, or
    with ``layout="words"`` ``[num_blocks * page_bytes / 4]`` uint32 (the same bytes).

    With a tensor-parallel ``mesh`` (``"tp"`` axis of size n) ``config`` is one device's plan
    (its own KV heads' pages) and each buffer is ``[n * num_blocks * page_bytes]`` split over
    ``"tp"``: device i's shard is a flat buffer of ``num_blocks`` pages of its own heads.

    Zeros, not ``jnp.empty``: from jax 0.11 ``empty`` may return uninitialised memory, and a
    fresh block must never expose NaN bit patterns to a kernel that masks by multiplication.
    """
    dtype = buffer_dtype(layout)
    check_page_alignment(config)
    page = page_size_bytes(config) if config.kv_cache_groups else 0
    buffers = []
    for t in config.kv_cache_tensors:
        if t.size != config.num_blocks * page:
            raise ValueError(
                f"tensor shared by {t.shared_by} has {t.size} bytes, expected "
                f"num_blocks * page = {config.num_blocks} * {page}"
            )
        size = t.size // dtype.itemsize
        if mesh is None:
            buffers.append(jnp.zeros((size,), dtype))
        else:
            shards = mesh.shape[TP_AXIS]
            buffers.append(
                jnp.zeros(
                    (shards * size,), dtype, device=NamedSharding(mesh, PartitionSpec(TP_AXIS))
                )
            )
    return tuple(buffers)


def _paged(buffer: jax.Array, page_bytes: int) -> jax.Array:
    """``[N, page_bytes]`` of a uint8 buffer; ``[N, page_words / 1024, 8, 128]`` of a uint32
    one (whole TPU tiles in the flat order: free under TPU tiling; ``[N, page_words]`` when a
    page is not whole tiles, which the word layout never makes)."""
    ok = buffer.ndim == 1 and buffer.dtype in KV_LAYOUTS.values()
    item = buffer.dtype.itemsize if ok else 1
    if not ok or page_bytes % item or buffer.shape[0] % (page_bytes // item):
        raise ValueError(
            f"expected a flat uint8 or uint32 buffer of whole {page_bytes}-byte pages, got "
            f"{buffer.dtype}{list(buffer.shape)}"
        )
    per_page = page_bytes // item
    n = buffer.shape[0] // per_page
    if item == 4 and per_page % _TILE_WORDS == 0:
        return buffer.reshape(n, per_page // _TILE_WORDS, 8, 128)
    return buffer.reshape(n, per_page)


def _pages_as_bytes(pages: jax.Array, page_bytes: int) -> jax.Array:
    """Gathered pages ``[K, ...]`` of either layout as ``[K, page_bytes]`` uint8."""
    if pages.dtype != jnp.uint8:
        pages = jax.lax.bitcast_convert_type(pages, jnp.uint8)  # [K, ..., 4], little-endian
    return pages.reshape(pages.shape[0], page_bytes)


def _bytes_as_pages(data: jax.Array, like: jax.Array) -> jax.Array:
    """``_pages_as_bytes``' inverse: ``[K, page_bytes]`` uint8 -> pages shaped as ``like``'s."""
    if like.dtype == jnp.uint8:
        return data.reshape(data.shape[0], *like.shape[1:])
    item = like.dtype.itemsize
    return jax.lax.bitcast_convert_type(
        data.reshape(data.shape[0], *like.shape[1:], item), like.dtype
    )


def _safe_ids(block_ids: jax.Array, num_blocks: int) -> jax.Array:
    # Negative ids would wrap (x.at[-1] is the last block): send them out of range instead.
    return jnp.where(block_ids < 0, num_blocks, block_ids)


def zero_blocks(
    buffer: jax.Array, block_ids: jax.Array, *, page_bytes: int, cpu_kernel: bool = False
) -> jax.Array:
    """Zeroes whole pages in place.

    Args:
      buffer: [N * page_bytes] uint8, or [N * page_bytes / 4] uint32 (the word layout).
      block_ids: [K] int32; ids < 0 or >= N are padding and touch nothing.
      cpu_kernel: use the C++ FFI call (``cpu_backend.zero_pages``) where the C++ kernels run:
        the engine does with the "cpu" attention backend, whose KV write is a C++ call too (an
        XLA scatter next to it made XLA copy the whole buffer).
    Returns:
      The updated buffer, the same shape and dtype.
    """
    pages = _paged(buffer, page_bytes)
    if cpu_kernel and buffer.dtype == jnp.uint8:
        from jaxkv.pallas_kernels import cpu_backend

        if cpu_backend.use_cpu_kernels():
            return cpu_backend.zero_pages(buffer, block_ids, page_bytes=page_bytes)
    ids = _safe_ids(block_ids, pages.shape[0])
    return pages.at[ids].set(jnp.zeros((), buffer.dtype), mode="drop").reshape(-1)


def zero_blocks_all(
    buffers: tuple[jax.Array, ...],  # per KV tensor: flat uint8 / uint32
    block_ids: jax.Array,  # [K] int32, as in zero_blocks
    *,
    page_bytes: int,
    cpu_kernel: bool = False,
    mesh=None,
) -> tuple[jax.Array, ...]:
    """``zero_blocks`` on every KV tensor's buffer (a block id names one page in each).

    With a tensor-parallel ``mesh`` (buffers split over ``"tp"`` as ``allocate_kv_buffers``
    makes them) each device zeroes the pages in its own shard.
    """

    def zero(bufs, ids):
        return tuple(
            zero_blocks(b, ids, page_bytes=page_bytes, cpu_kernel=cpu_kernel) for b in bufs
        )

    if mesh is None:
        return zero(tuple(buffers), block_ids)
    shard = PartitionSpec(TP_AXIS)
    return jax.shard_map(
        zero,
        mesh=mesh,
        in_specs=((shard,) * len(buffers), PartitionSpec()),
        out_specs=(shard,) * len(buffers),
        check_vma=False,
    )(tuple(buffers), block_ids)


def read_blocks(buffer: jax.Array, block_ids: jax.Array, *, page_bytes: int) -> jax.Array:
    """Copies pages out: [K, page_bytes] uint8 (out-of-range ids read zeros). A word-layout
    buffer's pages come out as their bytes (only the K pages are bitcast)."""
    pages = _paged(buffer, page_bytes)
    ids = _safe_ids(block_ids, pages.shape[0])
    return _pages_as_bytes(pages.at[ids].get(mode="fill", fill_value=0), page_bytes)


def write_blocks(
    buffer: jax.Array, block_ids: jax.Array, data: jax.Array, *, page_bytes: int
) -> jax.Array:
    """Writes whole pages in place: ``data`` [K, page_bytes] uint8 (``read_blocks``' rows)
    into ``block_ids`` [K]; the buffer keeps its shape and dtype."""
    pages = _paged(buffer, page_bytes)
    if data.shape != (block_ids.shape[0], page_bytes) or data.dtype != jnp.uint8:
        raise ValueError(
            f"data must be uint8[{block_ids.shape[0]}, {page_bytes}], got {data.dtype}{list(data.shape)}"
        )
    ids = _safe_ids(block_ids, pages.shape[0])
    return pages.at[ids].set(_bytes_as_pages(data, pages), mode="drop").reshape(-1)
