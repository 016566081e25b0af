"""Physical KV memory: one flat uint8 buffer per ``KVCacheTensor``.

Block ``b`` of a buffer is the contiguous byte range ``[b * page_bytes, (b + 1) * page_bytes)``
(``pallas_kernels`` lays every page out inside that range), so zeroing, reading or moving a
block is one contiguous slice whatever the attention layout. Typed per-layer views come from
``jaxkv.pallas_kernels.kv_cache_view`` (a bitcast, never a copy). All ops here are functional and
meant to run under ``jax.jit`` with the buffer donated, so XLA updates it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.kv_cache import PAGE_ALIGN_BYTES, KVCacheConfig
from jaxkv.models.sharding import TP_AXIS


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


def allocate_kv_buffers(config: KVCacheConfig, *, mesh=None) -> tuple[jax.Array, ...]:
    """Zero-filled flat uint8 buffers, one per tensor: ``[num_blocks * page_bytes]`` each.

    With a tensor-parallel ``mesh`` (``"tp"`` axis of size n) ``config`` is one device's plan
    (its own KV heads' pages) and each buffer is ``[n * num_blocks * page_bytes]`` split over
    ``"tp"``: device i's shard is a flat buffer of ``num_blocks`` pages of its own heads.

    Zeros, not ``jnp.empty``: from jax 0.11 ``empty`` may return uninitialised memory, and a
    fresh block must never expose NaN bit patterns to a kernel that masks by multiplication.
    """
    check_page_alignment(config)
    page = page_size_bytes(config) if config.kv_cache_groups else 0
    buffers = []
    for t in config.kv_cache_tensors:
        if t.size != config.num_blocks * page:
            raise ValueError(
                f"tensor shared by {t.shared_by} has {t.size} bytes, expected "
                f"num_blocks * page = {config.num_blocks} * {page}"
            )
        if mesh is None:
            buffers.append(jnp.zeros((t.size,), jnp.uint8))
        else:
            shards = mesh.shape[TP_AXIS]
            buffers.append(
                jnp.zeros(
                    (shards * t.size,),
                    jnp.uint8,
                    device=NamedSharding(mesh, PartitionSpec(TP_AXIS)),
                )
            )
    return tuple(buffers)


def _paged(buffer: jax.Array, page_bytes: int) -> jax.Array:
    if buffer.ndim != 1 or buffer.dtype != jnp.uint8 or buffer.shape[0] % page_bytes:
        raise ValueError(
            f"expected a flat uint8 buffer of whole {page_bytes}-byte pages, got "
            f"{buffer.dtype}{list(buffer.shape)}"
        )
    return buffer.reshape(buffer.shape[0] // page_bytes, page_bytes)


def _safe_ids(block_ids: jax.Array, num_blocks: int) -> jax.Array:
    # Negative ids would wrap (x.at[-1] is the last block): send them out of range instead.
    return jnp.where(block_ids < 0, num_blocks, block_ids)


def zero_blocks(
    buffer: jax.Array, block_ids: jax.Array, *, page_bytes: int, cpu_kernel: bool = False
) -> jax.Array:
    """Zeroes whole pages in place.

    Args:
      buffer: [N * page_bytes] uint8.
      block_ids: [K] int32; ids < 0 or >= N are padding and touch nothing.
      cpu_kernel: use the C++ FFI call (``cpu_backend.zero_pages``) where the C++ kernels run:
        the engine does with the "cpu" attention backend, whose KV write is a C++ call too (an
        XLA scatter next to it made XLA copy the whole buffer).
    Returns:
      The updated buffer, [N * page_bytes] uint8.
    """
    pages = _paged(buffer, page_bytes)
    if cpu_kernel:
        from jaxkv.pallas_kernels import cpu_backend  # noqa: PLC0415

        if cpu_backend.use_cpu_kernels():
            return cpu_backend.zero_pages(buffer, block_ids, page_bytes=page_bytes)
    ids = _safe_ids(block_ids, pages.shape[0])
    return pages.at[ids].set(jnp.uint8(0), mode="drop").reshape(-1)


def zero_blocks_all(
    buffers: tuple[jax.Array, ...],  # per KV tensor: [N * page_bytes] uint8
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
    """Copies pages out: [K, page_bytes] uint8 (out-of-range ids read zeros)."""
    pages = _paged(buffer, page_bytes)
    ids = _safe_ids(block_ids, pages.shape[0])
    return pages.at[ids].get(mode="fill", fill_value=0)


def write_blocks(
    buffer: jax.Array, block_ids: jax.Array, data: jax.Array, *, page_bytes: int
) -> jax.Array:
    """Writes whole pages in place: ``data`` [K, page_bytes] uint8 into ``block_ids`` [K]."""
    pages = _paged(buffer, page_bytes)
    if data.shape != (block_ids.shape[0], page_bytes) or data.dtype != jnp.uint8:
        raise ValueError(
            f"data must be uint8[{block_ids.shape[0]}, {page_bytes}], got {data.dtype}{list(data.shape)}"
        )
    ids = _safe_ids(block_ids, pages.shape[0])
    return pages.at[ids].set(data, mode="drop").reshape(-1)
