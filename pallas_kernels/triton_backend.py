"""Paged-attention kernel for GPU through Pallas' Triton lowering (everything Triton-specific).

Tile sizes (rows, pages per KV tile, splits, warps) come from ``tiles.choose_tiles`` and the
per-tile metadata columns from ``tiles.META_COLUMNS``.

One program per (query tile, KV head, KV split). A query tile is ``M`` rows = ``tile_q`` query
tokens x ``G`` query heads of one KV head (row r = token r // G, head r % G), padded to a power
of two >= 16 so the dots are legal Triton tiles. The program loops (``fori_loop`` with bounds
from the tile's metadata: no dynamic grid, no scalar prefetch) over KV tiles of
``block_k = pages_per_tile * bs`` keys (>= 16, power of two): it loads the tile's block ids as a
vector from the block table and gathers the pages' [bs, D] K and V tiles of its head (one
contiguous run each in the ``[N, 2, Hkv, bs, D]`` layout), then does an online-softmax update.

Never-read guarantee: KV tiles wholly outside [key_lo, key_hi) are skipped by the loop bounds,
and inside a KV tile every block that holds no needed key has its id replaced by
NULL_BLOCK_ID before the load, so garbage table entries are never dereferenced. V rows
outside the key range are zeroed (0 * NaN = NaN).

Replace this module (same ``attend_tiles`` signature) to use another GPU lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID
from jaxkv.pallas_kernels.tiles import (
    KV_HI,
    KV_LO,
    KV_T0,
    KV_T1,
    NUM_Q,
    POS0,
    SEQ,
    triton_num_warps,
)

_MASK = -1e30  # finite "minus infinity": keeps exp(m_prev - m_new) well defined


def _kernel(
    scale_ref,  # [1] float32 sm_scale * k_scale (whole array)
    meta_ref,  # [NT, META_COLS] int32 (whole array; scalar loads), tiles.META_COLUMNS
    tables_ref,  # [S, Bp] int32 (whole array), Bp a multiple of pages_per_tile
    q_ref,  # [M, D] this tile's rows for this KV head (unscaled)
    kv_ref,  # [N, 2, Hkv, bs, D] cache dtype (whole array)
    o_ref,  # [M, D] float32, normalised partial output of this split
    m_ref,  # [M] float32 running max of this split
    l_ref,  # [M] float32 softmax denominator of this split
    *,
    group,
    block_size,
    pages_per_tile,
    num_splits,
    sliding_window,
    soft_cap,
    compute_dtype,
):
    tile, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = meta_ref[tile, SEQ]
    pos0 = meta_ref[tile, POS0]
    num_q = meta_ref[tile, NUM_Q]
    key_lo = meta_ref[tile, KV_LO]  # first needed key position of the tile
    key_hi = meta_ref[tile, KV_HI]  # one past the last needed key position
    t0 = meta_ref[tile, KV_T0]  # KV tiles [t0, t1) hold every needed key
    t1 = meta_ref[tile, KV_T1]
    per_split = (t1 - t0 + num_splits - 1) // num_splits
    j_lo = t0 + split * per_split
    j_hi = jnp.minimum(t1, j_lo + per_split)

    rows, head_size = q_ref.shape
    block_k = pages_per_tile * block_size
    q = q_ref[...].astype(compute_dtype)  # [M, D]
    logit_scale = scale_ref[0]
    token = lax.div(lax.broadcasted_iota(jnp.int32, (rows,), 0), jnp.int32(group))
    q_pos = pos0 + token  # [M]
    row_ok = token < num_q

    def body(j, carry):
        acc, m_prev, l_prev = carry
        cols = j * pages_per_tile + lax.broadcasted_iota(jnp.int32, (pages_per_tile,), 0)
        ids = tables_ref[seq, pl.ds(j * pages_per_tile, pages_per_tile)]  # [ppt]
        used = ((cols + 1) * block_size > key_lo) & (cols * block_size < key_hi)
        ids = jnp.where(used, ids, NULL_BLOCK_ID)
        k = kv_ref[ids, 0, head].reshape(block_k, head_size).astype(compute_dtype)  # [BK, D]
        v = kv_ref[ids, 1, head].reshape(block_k, head_size).astype(compute_dtype)
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # [BK]
        key_ok = (k_pos >= key_lo) & (k_pos < key_hi)
        v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))

        s = (
            lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * logit_scale
        )  # [M, BK]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_ok[:, None] & key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s, _MASK)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [M]
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [M, BK]
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            p.astype(compute_dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, D]
        return alpha[:, None] * acc + pv, m_new, l_new

    init = (
        jnp.zeros((rows, head_size), jnp.float32),
        jnp.full((rows,), _MASK, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(j_lo, j_hi, body, init)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...] = m
    l_ref[...] = l


def attend_tiles(
    logit_scale,  # [1] float32, sm_scale * k_scale (scaled in f32, after the dot)
    meta,  # [NT, META_COLS] int32, tiles.META_COLUMNS (tiles.tile_meta)
    tables,  # [S, Bp] int32, Bp a multiple of pages_per_tile
    q_tiles,  # [NT, Hkv, M, D] compute dtype, M a power of two >= 16
    kv_cache,  # [N, 2, Hkv, bs, D] cache dtype
    *,
    group: int,
    pages_per_tile: int,
    num_splits: int,
    sliding_window,
    soft_cap,
    compute_dtype,
    interpret: bool,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """Runs the kernel; returns (o [P, NT, Hkv, M, D] f32, m [P, NT, Hkv, M], l [P, NT, Hkv, M]).

    ``num_warps`` None: ``tiles.triton_num_warps`` of the tile (``tiles.choose_tiles`` passes
    the same number)."""
    nt, num_kv_heads, rows, head_size = q_tiles.shape
    if num_warps is None:
        num_warps = triton_num_warps(rows, head_size)
    block_size = kv_cache.shape[3]
    kernel = functools.partial(
        _kernel,
        group=group,
        block_size=block_size,
        pages_per_tile=pages_per_tile,
        num_splits=num_splits,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        compute_dtype=compute_dtype,
    )
    grid = (nt, num_kv_heads, num_splits)
    whole = pl.BlockSpec()  # no block shape: the kernel gets the whole array and indexes it
    out_shape = [
        jax.ShapeDtypeStruct((num_splits, nt, num_kv_heads, rows, head_size), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, nt, num_kv_heads, rows), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, nt, num_kv_heads, rows), jnp.float32),
    ]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            whole,  # logit_scale
            whole,  # meta
            whole,  # tables
            pl.BlockSpec((None, None, rows, head_size), lambda i, h, s: (i, h, 0, 0)),
            whole,  # kv_cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_size), lambda i, h, s: (s, i, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0)),
        ],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_m{rows}_bk{pages_per_tile * block_size}",
    )(logit_scale, meta, tables, q_tiles, kv_cache)
