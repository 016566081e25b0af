"""Paged-attention kernel for TPU through Pallas' Mosaic lowering (everything Mosaic-specific).

Same contract as ``triton_backend.attend_tiles`` (query tiles of ``M`` rows = ``tile_q`` tokens
x ``G`` query heads of one KV head, row r = token r // G, per-tile metadata from
``tiles.tile_meta`` with the columns ``tiles.META_COLUMNS``, sizes from ``tiles.choose_tiles``),
written the way a TPU kernel is:

* Scalar prefetch (``pltpu.PrefetchScalarGridSpec``): the tile metadata ``[NT * 8]`` and the
  block tables ``[S * Bp]`` (both flattened: 2-D SMEM arrays pad their minor dim) are copied
  to SMEM before the grid runs, so block ids are scalar reads.
* The KV cache stays in HBM (``memory_space=pl.ANY``). One program per (query tile, KV head)
  loops over KV tiles of ``block_k = pages_per_tile * bs`` keys; each KV tile is
  ``2 * pages_per_tile`` async DMAs (``pltpu.make_async_copy``: K and V ``[bs, D]`` runs of one
  page and head, contiguous in the ``[N, 2, Hkv, bs, D]`` layout) into a double-buffered VMEM
  scratch ``[2, block_k, D]``; tile j + 1 is in flight while tile j is computed.
* Online softmax with VMEM scratch accumulators (m, l: ``[M, 1]``; acc: ``[M, D]`` float32),
  reset per program. No KV splits: a TPU core runs the grid sequentially, so splitting a
  sequence's keys only adds a combine pass (flash-decoding is a GPU occupancy trick).

Never-read guarantee (as in the Triton kernel): KV tiles outside [key_lo, key_hi) are never
visited, pages of a visited tile that hold no needed key are fetched from NULL_BLOCK_ID
instead of their (possibly garbage) table entry, logits outside the range are masked and V
rows outside it are zeroed before the P @ V dot (0 * NaN = NaN).

Sizes: ``head_size`` must be a multiple of 128 (the lane width: q, K, V and the output are
``[rows, D]`` tiles) and ``block_size`` a multiple of 8 (a page is whole sublane rows of the
VMEM buffer); :func:`check_shapes` raises ValueError otherwise, before tracing.

Caveat: only checked in TPU interpret mode on CPU (``interpret=pltpu.InterpretParams()``) and by
lowering to Mosaic MLIR; not yet run on TPU hardware. For 16-bit caches with ``bs < 16`` and
fp8 caches with ``bs < 32`` a page's DMA lands at a sublane offset inside a packed VMEM tile,
which Mosaic may reject at compile time on some chips.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID
from jaxkv.pallas_kernels.tiles import (
    KV_HI,
    KV_LO,
    KV_T0,
    KV_T1,
    META_COLS,
    NUM_Q,
    POS0,
    SEQ,
)

LANES = 128
_MASK = -1e30  # finite "minus infinity": keeps exp(m_prev - m_new) well defined

#: SMEM of a TPU core: 1 MiB on v4, v5e, v5p, v6e and v7x (the TPU compiler's own figure in
#: its out-of-memory report: "Used 1.00M of 1.00M smem"; jax 0.10.2, libtpu 0.0.42.1).
SMEM_BYTES = 1 << 20
#: Left to the rest of the program: XLA's scalars and Mosaic's own (~1.1 KiB measured).
SMEM_RESERVE = 16 << 10


def check_shapes(*, head_size: int, block_size: int) -> None:
    """Raises ValueError for sizes the Mosaic kernel does not support (before tracing)."""
    if head_size % LANES:
        raise ValueError(
            f"lowering='mosaic' needs head_size to be a multiple of {LANES} "
            f"(TPU lane width), got {head_size}"
        )
    if block_size % 8:
        raise ValueError(
            f"lowering='mosaic' needs block_size to be a multiple of 8 (TPU "
            f"sublanes), got {block_size}"
        )


def interpret_params(interpret: bool):
    """The ``interpret`` argument of a Mosaic ``pallas_call``: TPU interpret mode (simulated
    DMAs, semaphores and SMEM) when asked for, else compile for TPU."""
    return pltpu.InterpretParams() if interpret else False


def _kernel(
    meta_ref,  # [NT * META_COLS] int32 SMEM (scalar prefetch), tiles.META_COLUMNS
    tables_ref,  # [S * Bp] int32 SMEM (scalar prefetch), row-major block tables
    scale_ref,  # [1] float32 SMEM, sm_scale * k_scale
    q_ref,  # [M, D] VMEM, this tile's rows for this KV head (unscaled)
    kv_hbm,  # [N, 2, Hkv, bs, D] cache dtype, or the word view [N, 2, Hkv, C, bs / pack,
    # 128] uint32 (``word_dtype`` set), left in HBM
    o_ref,  # [M, D] float32 VMEM, normalised output
    k_buf,  # [2, BK, D] cache dtype VMEM scratch (double buffer); words: [2, C, BK / pack, 128]
    v_buf,  # the same for V
    sems,  # [2] DMA semaphores, one per buffer slot
    m_ref,  # [M, 1] float32 VMEM scratch, running max
    l_ref,  # [M, 1] float32 VMEM scratch, softmax denominator
    acc_ref,  # [M, D] float32 VMEM scratch, unnormalised output
    *,
    width,
    group,
    block_size,
    pages_per_tile,
    sliding_window,
    soft_cap,
    compute_dtype,
    word_dtype,
):
    tile, head = pl.program_id(0), pl.program_id(1)
    base = tile * META_COLS
    seq = meta_ref[base + SEQ]
    pos0 = meta_ref[base + POS0]
    num_q = meta_ref[base + NUM_Q]
    key_lo = meta_ref[base + KV_LO]  # first needed key position of the tile
    key_hi = meta_ref[base + KV_HI]  # one past the last needed key position
    t0 = meta_ref[base + KV_T0]  # KV tiles [t0, t1) hold every needed key
    t1 = meta_ref[base + KV_T1]
    rows, head_size = q_ref.shape
    block_k = pages_per_tile * block_size
    page_rows = None if word_dtype is None else block_size * jnp.dtype(word_dtype).itemsize // 4

    def tile_copies(j, slot):
        """The 2 * pages_per_tile DMAs of KV tile j into buffer ``slot`` (same list to wait)."""
        copies = []
        for p in range(pages_per_tile):
            col = j * pages_per_tile + p
            used = ((col + 1) * block_size > key_lo) & (col * block_size < key_hi)
            block = jnp.where(used, tables_ref[seq * width + col], NULL_BLOCK_ID)
            for kv, buf in ((0, k_buf), (1, v_buf)):
                if word_dtype is None:  # [bs, D] run of the typed cache
                    dst = buf.at[slot, pl.ds(p * block_size, block_size)]
                else:  # [C, bs / pack, 128] word tiles: whole TPU tiles
                    dst = buf.at[slot, :, pl.ds(p * page_rows, page_rows)]
                copies.append(pltpu.make_async_copy(kv_hbm.at[block, kv, head], dst, sems.at[slot]))
        return copies

    def load(buf, slot):
        """KV tile ``slot`` as [BK, D] in the compute dtype (word tiles unpacked in VMEM)."""
        if word_dtype is None:
            return buf[slot].astype(compute_dtype)
        chunks = [pltpu.bitcast(buf[slot, c], word_dtype) for c in range(buf.shape[1])]
        x = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=1)
        return x.astype(compute_dtype)

    m_ref[...] = jnp.full(m_ref.shape, _MASK, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t0 < t1)
    def _():
        for c in tile_copies(t0, 0):
            c.start()

    q = q_ref[...].astype(compute_dtype)  # [M, D]
    logit_scale = scale_ref[0]
    token = lax.div(lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), jnp.int32(group))
    q_pos = pos0 + token  # [M, BK]
    row_ok = token < num_q

    def body(j, carry):
        slot = lax.rem(j - t0, 2)

        @pl.when(j + 1 < t1)
        def _():
            for c in tile_copies(j + 1, 1 - slot):
                c.start()

        for c in tile_copies(j, slot):
            c.wait()
        k = load(k_buf, slot)  # [BK, D]
        v = load(v_buf, slot)
        v_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, head_size), 0)
        v = jnp.where((v_pos >= key_lo) & (v_pos < key_hi), v, jnp.zeros_like(v))

        s = (
            lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * logit_scale
        )  # [M, BK]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = row_ok & (k_pos >= key_lo) & (k_pos < key_hi) & (k_pos <= q_pos)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        s = jnp.where(mask, s, _MASK)
        m_prev = m_ref[...]  # [M, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # [M, BK]
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(
            p.astype(compute_dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, D]
        acc_ref[...] = alpha * acc_ref[...] + pv
        m_ref[...] = m_new
        return carry

    lax.fori_loop(t0, t1, body, 0)
    l = l_ref[...]
    o_ref[...] = acc_ref[...] / jnp.where(l > 0, l, 1.0)


def smem_bytes(*, num_tiles: int, table_entries: int) -> int:
    """The SMEM the attention kernel's scalar operands take: the tile metadata, the block
    tables and the logit scale, each a 1-D int32 / float32 array that Mosaic lays out in tiles
    of 128 words (``#tpu.tiled<(128)>``: its lowered kernel, ``tpu_aot.mosaic_smem``)."""

    def words(n: int) -> int:
        return -(-n // LANES) * LANES

    return 4 * (words(num_tiles * META_COLS) + words(table_entries) + words(1))


def check_smem(*, num_tiles: int, num_seqs: int, table_width: int) -> None:
    """Raises ValueError when the block tables and tile metadata do not fit a TPU core's SMEM,
    where the kernel scalar-prefetches them (the compiler would fail with RESOURCE_EXHAUSTED)."""
    need = smem_bytes(num_tiles=num_tiles, table_entries=num_seqs * table_width)
    if need > SMEM_BYTES - SMEM_RESERVE:
        raise ValueError(
            f"the TPU attention kernel keeps the block tables in SMEM: {num_seqs} sequences x "
            f"{table_width} blocks plus {num_tiles} tiles' metadata need {need} B, more than "
            f"the {SMEM_BYTES - SMEM_RESERVE} B a TPU core's {SMEM_BYTES >> 20} MiB of SMEM "
            f"leaves; lower max_num_seqs or max_model_len, or raise block_size"
        )


def attend_tiles(
    logit_scale,  # [1] float32, sm_scale * k_scale (applied in f32 after the dot)
    meta,  # [NT, META_COLS] int32, tiles.META_COLUMNS (tiles.tile_meta)
    tables,  # [S, Bp] int32, Bp a multiple of pages_per_tile
    q_tiles,  # [NT, Hkv, M, D] compute dtype, M from tiles.mosaic_tile_rows
    kv_cache,  # [N, 2, Hkv, bs, D] cache dtype, or WordPages
    *,
    group: int,
    pages_per_tile: int,
    sliding_window,
    soft_cap,
    compute_dtype,
    interpret: bool,
):
    """Runs the kernel; returns o [NT, Hkv, M, D] float32 (rows normalised; empty rows 0)."""
    nt, num_kv_heads, rows, head_size = q_tiles.shape
    width = tables.shape[1]
    block_size = kv_cache.shape[3]
    check_shapes(head_size=head_size, block_size=block_size)
    if not interpret:
        check_smem(num_tiles=nt, num_seqs=tables.shape[0], table_width=width)
    block_k = pages_per_tile * block_size
    word_dtype = None
    buf_shape = (2, block_k, head_size)
    if isinstance(kv_cache, WordPages):
        word_dtype = kv_cache.dtype
        pack = 4 // word_dtype.itemsize
        buf_shape = (2, head_size // LANES, block_k // pack, LANES)
        kv_cache = kv_cache.words
    kernel = functools.partial(
        _kernel,
        width=width,
        group=group,
        block_size=block_size,
        pages_per_tile=pages_per_tile,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        compute_dtype=compute_dtype,
        word_dtype=word_dtype,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # meta, tables
        grid=(nt, num_kv_heads),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),  # logit_scale
            pl.BlockSpec((None, None, rows, head_size), lambda i, h, *_: (i, h, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),  # kv_cache (HBM)
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_size), lambda i, h, *_: (i, h, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM(buf_shape, kv_cache.dtype),
            pltpu.VMEM(buf_shape, kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, head_size), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((nt, num_kv_heads, rows, head_size), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name=f"ragged_paged_attention_mosaic{'_words' if word_dtype else ''}_m{rows}_bk{block_k}",
    )(meta.reshape(-1), tables.reshape(-1), logit_scale, q_tiles, kv_cache)


@dataclasses.dataclass(frozen=True)
class WordPages:
    """A word-layout cache (``layout.kv_cache_word_view``) handed through the lowering-neutral
    glue of ``pallas_attention`` as if it were the typed cache it stands for: ``shape`` and
    ``dtype`` are the typed ``[N, 2, Hkv, bs, D]`` view's, ``words`` the uint32 array."""

    words: jax.Array  # [N, 2, Hkv, D / 128, bs / pack, 128] uint32
    dtype: jnp.dtype  # the cache dtype

    @property
    def shape(self) -> tuple[int, ...]:
        n, two, hkv, chunks, rows, lanes = self.words.shape
        return (n, two, hkv, rows * (4 // self.dtype.itemsize), chunks * lanes)


def kernel_memory_estimate(
    *,
    rows: int,
    block_k: int,
    head_size: int,
    q_dtype,
    cache_dtype,
    num_tiles: int,
    table_entries: int,
) -> tuple[int, int]:
    """``(VMEM, SMEM)`` bytes one attention kernel of these sizes needs, counted the way
    tpu-inference sizes its kernels: the double-buffered q and output blocks, the K and V
    double buffers, m / l (a lane-padded [M, 128] f32 each) and the f32 accumulator in VMEM;
    the scalar-prefetched tile metadata and block tables plus the scale in SMEM
    (:func:`smem_bytes`). Mosaic's own VMEM figure (``jaxkv.tpu_aot.mosaic_kernels``) is the
    one to trust; this says what the sizes are made of and scales them to shapes not
    compiled."""
    q_item, kv_item = jnp.dtype(q_dtype).itemsize, jnp.dtype(cache_dtype).itemsize
    vmem = (
        2 * rows * head_size * q_item  # q block, double-buffered
        + 2 * rows * head_size * 4  # output block
        + 2 * 2 * block_k * head_size * kv_item  # K and V, two slots each
        + 2 * rows * LANES * 4  # m, l
        + rows * head_size * 4
    )  # acc
    return vmem, smem_bytes(num_tiles=num_tiles, table_entries=table_entries)
