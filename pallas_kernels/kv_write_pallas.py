"""``write_kv(backend="pallas")``: the slot-mapping scatter of new K/V bytes as a Pallas kernel.

Same bytes as the XLA scatter in ``kv_write.py``: the caller converts the new K/V to the cache
dtype and bitcasts them to bytes; the kernels only move byte rows of ``R = D * itemsize`` bytes.
The cache is an aliased output (``input_output_aliases``): rows no token maps to are never
touched, so with the buffer donated the write is in place. Token t with slot s writes, for
every (K|V c, KV head h), the row ``[s // bs, c, h, s % bs]`` of the page-major
``[N, 2, Hkv, bs, R]`` byte view; slots < 0 (PAD_SLOT_ID) and slots >= N * bs write nothing
(as the XLA scatter's ``mode="drop"``).

Two kernels, one per lowering (``validation.resolve_lowering``):

* Triton (GPU): no scalar prefetch, no DMA. One program per (block of ``BT`` tokens, c, h)
  loads the block's slot ids as a vector, turns them into row indices of the
  ``[N * 2 * Hkv * bs, R]`` view and does one masked scatter store of the ``[BT, R]`` rows
  (masked rows: padding and out-of-range slots). Needs a power-of-two ``R``.
* Mosaic (TPU): the slot mapping is scalar-prefetched into SMEM; both the new bytes and the
  cache stay in HBM (``pl.ANY``) and each valid token is one HBM -> HBM DMA of its
  ``[2, Hkv, 1, R]`` rows (a strided destination: K and V of every head at offset s % bs of
  page s // bs). A grid step starts the DMAs of ``BT`` tokens, then waits for them all.
  Checked in TPU interpret mode and by lowering to Mosaic MLIR only (not yet on hardware).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxkv.pallas_kernels.mosaic_backend import interpret_params
from jaxkv.pallas_kernels.validation import resolve_lowering

#: Tokens per program (Triton) / per grid step (Mosaic).
TRITON_BLOCK_TOKENS = 16
MOSAIC_BLOCK_TOKENS = 64


def _triton_kernel(
    slot_ref,  # [BT] int32, this block's slot ids (PAD_SLOT_ID = -1 past T)
    upd_ref,  # [BT, R] uint8, rows of (c, h) of this block's tokens
    cache_in,  # [N * 2 * Hkv * bs, R] uint8 (aliased to cache_out; unused)
    cache_out,  # [N * 2 * Hkv * bs, R] uint8
    *,
    block_size,
    num_kv_heads,
    num_slots,
):
    del cache_in
    c, h = pl.program_id(1), pl.program_id(2)
    slot = slot_ref[...]
    valid = (slot >= 0) & (slot < num_slots)
    safe = jnp.where(valid, slot, 0)
    rows = ((lax.div(safe, block_size) * 2 + c) * num_kv_heads + h) * block_size + lax.rem(
        safe, block_size
    )  # [BT]
    # Masked rows point past the end: never stored on GPU, dropped by interpret mode's scatter.
    rows = jnp.where(valid, rows, cache_out.shape[0])
    vals = upd_ref[...]  # [BT, R]
    cols = lax.broadcasted_iota(jnp.int32, vals.shape, 1)
    plgpu.store(
        cache_out.at[rows[:, None], cols], vals, mask=jnp.broadcast_to(valid[:, None], vals.shape)
    )


def _write_triton(
    table,  # [N * 2 * Hkv * bs, R] uint8
    updates,  # [T, 2, Hkv, R] uint8
    slots,  # [T] int32
    *,
    block_size,
    num_kv_heads,
    block_tokens,
    interpret,
):
    num_tokens, _, _, row_bytes = updates.shape
    bt = block_tokens
    padded = -(-num_tokens // bt) * bt
    slots = jnp.pad(slots, (0, padded - num_tokens), constant_values=-1)
    updates = jnp.pad(updates, ((0, padded - num_tokens), (0, 0), (0, 0), (0, 0)))
    num_slots = table.shape[0] // (2 * num_kv_heads)
    kernel = functools.partial(
        _triton_kernel, block_size=block_size, num_kv_heads=num_kv_heads, num_slots=num_slots
    )
    return pl.pallas_call(
        kernel,
        grid=(padded // bt, 2, num_kv_heads),
        in_specs=[
            pl.BlockSpec((bt,), lambda i, c, h: (i,)),
            pl.BlockSpec((bt, None, None, row_bytes), lambda i, c, h: (i, c, h, 0)),
            pl.BlockSpec(),  # whole cache
        ],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"write_kv_triton_r{row_bytes}",
    )(slots, updates, table)


def _mosaic_kernel(
    slot_ref,  # [T] int32 SMEM (scalar prefetch)
    new_hbm,  # [T, 2, Hkv, 1, R] uint8 in HBM
    cache_in,  # [N, 2, Hkv, bs, R] uint8 in HBM (aliased to cache_out; unused)
    cache_out,  # [N, 2, Hkv, bs, R] uint8 in HBM
    sem,  # DMA semaphore
    *,
    block_size,
    num_tokens,
    block_tokens,
    num_slots,
):
    del cache_in
    first = pl.program_id(0) * block_tokens
    count = jnp.minimum(block_tokens, num_tokens - first)

    def copy(t):
        slot = slot_ref[t]
        valid = (slot >= 0) & (slot < num_slots)
        slot = jnp.where(valid, slot, 0)
        dst = cache_out.at[lax.div(slot, block_size), :, :, pl.ds(lax.rem(slot, block_size), 1)]
        return valid, pltpu.make_async_copy(new_hbm.at[t], dst, sem)

    def start(i, carry):
        valid, dma = copy(first + i)
        pl.when(valid)(dma.start)
        return carry

    def wait(i, carry):
        valid, dma = copy(first + i)
        pl.when(valid)(dma.wait)
        return carry

    lax.fori_loop(0, count, start, 0)
    lax.fori_loop(0, count, wait, 0)


def _write_mosaic(
    cache,  # [N, 2, Hkv, bs, R] uint8
    updates,  # [T, 2, Hkv, R] uint8
    slots,  # [T] int32
    *,
    block_tokens,
    interpret,
):
    num_tokens, _, num_kv_heads, row_bytes = updates.shape
    num_blocks, _, _, block_size, _ = cache.shape
    bt = min(block_tokens, num_tokens)
    kernel = functools.partial(
        _mosaic_kernel,
        block_size=block_size,
        num_tokens=num_tokens,
        block_tokens=bt,
        num_slots=num_blocks * block_size,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,  # slots
        grid=(-(-num_tokens // bt),),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={2: 0},  # operand 2 counts the scalar-prefetched slots
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret_params(interpret),
        name=f"write_kv_mosaic_r{row_bytes}",
    )(slots, updates.reshape(num_tokens, 2, num_kv_heads, 1, row_bytes), cache)


def write_kv_pallas(
    buffer,  # [N * page_bytes] uint8
    kb,  # [T, Hkv, R] uint8, new K in the cache dtype, as bytes
    vb,  # [T, Hkv, R] uint8, new V
    slots,  # [T] int32, block * bs + offset; < 0 or >= N * bs = no write
    *,
    block_size: int,
    interpret: bool = False,
    lowering: str | None = None,
    block_tokens: int | None = None,
) -> jax.Array:  # [N * page_bytes] uint8
    """Writes the byte rows of K and V (arguments checked by ``kv_write.write_kv``).

    block_tokens: tokens per Triton program / Mosaic grid step (None: 16 / 64; Triton needs a
    power of two, as it needs a power-of-two row of ``R`` bytes).
    """
    lowering = resolve_lowering(lowering, interpret)
    _, num_kv_heads, row_bytes = kb.shape
    if block_tokens is None:
        block_tokens = MOSAIC_BLOCK_TOKENS if lowering == "mosaic" else TRITON_BLOCK_TOKENS
    if block_tokens < 1 or (lowering == "triton" and block_tokens & (block_tokens - 1)):
        raise ValueError(
            f"block_tokens must be >= 1 (a power of two for Triton), got {block_tokens}"
        )
    if lowering == "triton" and row_bytes & (row_bytes - 1):
        raise ValueError(
            f"write_kv(backend='pallas', lowering='triton') needs a power-of-two "
            f"row of D * itemsize bytes, got {row_bytes}"
        )
    num_blocks = buffer.shape[0] // (2 * num_kv_heads * block_size * row_bytes)
    updates = jnp.stack([kb, vb], axis=1)  # [T, 2, Hkv, R]
    slots = slots.astype(jnp.int32)
    if lowering == "mosaic":
        cache = buffer.reshape(num_blocks, 2, num_kv_heads, block_size, row_bytes)
        return _write_mosaic(
            cache, updates, slots, block_tokens=block_tokens, interpret=interpret
        ).reshape(-1)
    table = buffer.reshape(num_blocks * 2 * num_kv_heads * block_size, row_bytes)
    return _write_triton(
        table,
        updates,
        slots,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        block_tokens=block_tokens,
        interpret=interpret,
    ).reshape(-1)
