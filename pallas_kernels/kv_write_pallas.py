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
  It does not compile for a TPU: a token's row sits at an offset inside a tiled dimension
  of the byte cache, which Mosaic's DMAs refuse ("Offsets along tiled dimensions must be
  aligned to tiles"). :func:`write_kv_words` is the TPU write.

``write_kv_words`` (TPU, the word layout of ``layout.kv_cache_word_view``): one grid step per
token; the token's row lies inside one aligned (8, 128) word tile per (K|V, head, 128-lane
chunk), so the step merges the new values into their bits of their word row in those
``2 * Hkv * C`` tiles held in VMEM (a shift and mask of 32-bit words: no sub-32-bit vector op,
so every TPU generation compiles it). Whole tiles only: every DMA is tile-aligned. Steps run in
order and a run of consecutive tokens whose slots fall in the same tiles (a prefill's rows:
``8 * pack`` slots a tile, 16 for bf16) shares one read of the tiles (at its first token) and
one write-back (at its last). Cost: two 4 KiB tile DMAs per (K|V, head, chunk) and run, one run
per token for a decode step, one per 16 bf16 rows of a prefill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxkv.pallas_kernels.layout import (
    WORD_LANES,
    WORD_SUBLANES,
    kv_cache_word_view,
    resolve_kv_dtype,
    word_packing,
)
from jaxkv.pallas_kernels.mosaic_backend import interpret_params
from jaxkv.pallas_kernels.validation import check_scales, check_write_inputs, resolve_lowering

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


def _words_kernel(
    slot_ref,  # [T] int32 SMEM (scalar prefetch)
    new_ref,  # [2 * Hkv * C, 128] uint32 VMEM: this token's values' bits (low bits)
    cache_in,  # [N, 2, Hkv, C, bs / pack, 128] uint32 in HBM (aliased; unused)
    cache_out,  # [N, 2, Hkv, C, bs / pack, 128] uint32 in HBM
    tiles,  # [2, Hkv, C, 8, 128] uint32 VMEM scratch: the token's word tiles
    sem,  # DMA semaphore
    *,
    block_size,
    pack,
    num_slots,
):
    del cache_in
    t, num_tokens = pl.program_id(0), pl.num_programs(0)
    rows_per_tile = WORD_SUBLANES * pack  # typed rows (slots) one word tile holds

    def tile_of(s):
        """The word tiles' id of slot ``s`` (block, group of 8 word rows), -1: no write."""
        return jnp.where((s >= 0) & (s < num_slots), lax.div(jnp.maximum(s, 0), rows_per_tile), -1)

    slot = slot_ref[t]
    tile = tile_of(slot)
    # A run of consecutive tokens in the same tiles (a prefill's rows) reads them once, at its
    # first token, and writes them back once, at its last: the scratch carries them between
    # grid steps (they run in order on one core).
    first = (t == 0) | (tile_of(slot_ref[jnp.maximum(t - 1, 0)]) != tile)
    last = (t == num_tokens - 1) | (tile_of(slot_ref[jnp.minimum(t + 1, num_tokens - 1)]) != tile)

    @pl.when(tile >= 0)
    def _():
        block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
        row = lax.div(offset, pack)  # word row in the page's tile column
        top = pl.multiple_of(lax.div(row, WORD_SUBLANES) * WORD_SUBLANES, WORD_SUBLANES)
        src = cache_out.at[block, :, :, :, pl.ds(top, WORD_SUBLANES)]

        @pl.when(first)
        def _():
            dma = pltpu.make_async_copy(src, tiles, sem)
            dma.start()
            dma.wait()

        bits = 32 // pack
        shift = (lax.rem(offset, pack) * bits).astype(jnp.uint32)
        keep = ~(jnp.uint32((1 << bits) - 1 if bits < 32 else 0xFFFFFFFF) << shift)
        hit = lax.broadcasted_iota(jnp.int32, (WORD_SUBLANES, WORD_LANES), 0) == row - top
        _, num_kv_heads, chunks, _, _ = tiles.shape
        for c in range(2):
            for h in range(num_kv_heads):
                for j in range(chunks):
                    r = (c * num_kv_heads + h) * chunks + j
                    new = new_ref[r : r + 1, :] << shift  # [1, 128]
                    old = tiles[c, h, j]  # [8, 128]
                    tiles[c, h, j] = jnp.where(hit, (old & keep) | new, old)

        @pl.when(last)
        def _():
            back = pltpu.make_async_copy(tiles, src, sem)
            back.start()
            back.wait()


def write_kv_words(
    buffer,  # [N * page_bytes / 4] uint32, the word layout
    k,  # [T, Hkv, D] model dtype
    v,  # [T, Hkv, D] model dtype
    slot_mapping,  # [T] int, block * bs + offset; < 0 or >= N * bs = no write
    *,
    block_size: int,
    dtype,
    k_scale=None,
    v_scale=None,
    interpret: bool = False,
) -> jax.Array:  # [N * page_bytes / 4] uint32
    """``write_kv`` for the TPU word layout (``layout.kv_cache_word_view``): the same values at
    the same slots, converted to the cache dtype (fp8: ``x / scale``), written in place (the
    buffer is an aliased output; donate it). A Mosaic kernel (``interpret=True``: TPU interpret
    mode, anywhere).

    Example (bf16, bs 16, pack 2): slot 37 = block 2, offset 5 -> word row 2 of block 2's tiles,
    high half; the kernel rewrites the (8, 128) tiles [2, c, h, j] holding word rows 0..7.
    """
    from jaxkv.pallas_kernels.layout import quantize_to_cache

    dt = resolve_kv_dtype(dtype)
    check_scales(dt, k_scale, v_scale)
    num_tokens, num_kv_heads, head_size = check_write_inputs(k, v, slot_mapping, interpret)
    cache = kv_cache_word_view(
        buffer, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dt
    )
    pack = word_packing(dt)
    chunks = head_size // WORD_LANES
    new = jnp.stack([quantize_to_cache(k, dt, k_scale), quantize_to_cache(v, dt, v_scale)], axis=1)
    new = lax.bitcast_convert_type(new, jnp.dtype(f"uint{8 * dt.itemsize}")).astype(jnp.uint32)
    new = new.reshape(num_tokens, 2 * num_kv_heads * chunks, WORD_LANES)  # [T, 2 * Hkv * C, 128]
    kernel = functools.partial(
        _words_kernel, block_size=block_size, pack=pack, num_slots=cache.shape[0] * block_size
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,  # slots
        grid=(num_tokens,),
        in_specs=[
            pl.BlockSpec((None, 2 * num_kv_heads * chunks, WORD_LANES), lambda t, s: (t, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[
            pltpu.VMEM((2, num_kv_heads, chunks, WORD_SUBLANES, WORD_LANES), jnp.uint32),
            pltpu.SemaphoreType.DMA(()),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={2: 0},  # operand 2 counts the scalar-prefetched slots
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret_params(interpret),
        name=f"write_kv_mosaic_words_{dt.name}",
    )(slot_mapping.astype(jnp.int32), new, cache)
    return out.reshape(-1)
