"""XLA (pure-jnp, gather-based) paged attention: the engine's CPU backend.

Work is proportional to each query's own sequence (see ``tiles.py``):
  * one gather of each sequence's needed blocks: [2, S, Hkv, L, D] (L = the table bucket's
    width, or only the blocks a sliding window can touch);
  * decode tiles: the last query row of every sequence attends its own gathered keys
    ([S, Hkv, L, D] x [S, Hkv, G, D]) -- a pure-decode batch (max_q_len=1) is only this;
  * prefill tiles: the remaining rows, ``tile_q`` at a time, each against its sequence's
    gathered keys; the tile count is bucketed (1, 4, 16, ..) at run time and ``lax.switch``
    runs the one branch of that static size, so a batch of many decodes and one prefill chunk
    never pads every sequence to the chunk length nor attends T x all-KV.

Block-table entries nobody needs are replaced by NULL_BLOCK_ID before the gather (they may be
garbage), and V rows outside the needed key range are zeroed (the page may hold NaN and
0 * NaN = NaN).

Measured on XLA:CPU (2 shared cores, bf16 decode S=32 x 1024 keys, Hq 16 / Hkv 4 / D 64): keys
on the lhs of the QK einsum (``tksd,tkmd->tksm``) 5.9 ms vs 45 ms for ``tkmd,tksd->tkms``;
bf16 x bf16 dots with f32 accumulation beat converting K/V to f32; gathering [bs, D] rows per
(block, head) beat gathering pages + transposing 2x. Whole call: 60-99 ms -> 28-35 ms.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiles as tiles_lib
from pallas_kernels.layout import compute_dtype
from pallas_kernels.metadata import NULL_BLOCK_ID

#: Rows per prefill tile (upper bound; smaller when max_q_len is small).
MAX_TILE_Q = 64


def _gather_seq_kv(kv_cache, block_tables, seqs: tiles_lib.Tiles, *, sliding_window):
    """ONE gather of every sequence's needed K/V: ([2, S, Hkv, L, D], kpos [S, L], key_ok [S, L]).

    ``seqs`` has one tile per sequence covering all its query rows, so [lo, hi) is the union
    of the keys any of its rows needs. One gather with one consumer matters on XLA:CPU: when
    ``kv_cache`` is ``kv_cache_view`` of a uint8 buffer, the size-changing bitcast is expanded
    into an elementwise pass that XLA fuses into a single gather, but materialises (a full
    cache copy per call, measured) as soon as two ops or a ``lax.switch`` branch read it.
    """
    num_blocks, _, num_kv_heads, block_size, head_size = kv_cache.shape
    num_seq_rows, max_blocks = block_tables.shape
    first, end, nb = tiles_lib.kv_block_range(seqs, block_size=block_size, max_blocks=max_blocks,
                                              sliding_window=sliding_window)
    bidx = first[:, None] + jnp.arange(nb, dtype=jnp.int32)[None, :]     # [S, nb]
    needed = bidx < end[:, None]
    ids = jnp.where(needed, jnp.take_along_axis(block_tables, jnp.minimum(bidx, max_blocks - 1),
                                                axis=1), NULL_BLOCK_ID)
    # Gather (block, K|V, head) tiles -- contiguous [bs * D] rows of the page-major cache --
    # straight into [2, S, Hkv, nb, bs, D]: ~2x faster on XLA:CPU than gathering whole pages
    # and transposing them (one pass over the KV instead of three).
    tile_rows = kv_cache.reshape(num_blocks * 2 * num_kv_heads, block_size * head_size)
    kv_sel = jnp.arange(2, dtype=jnp.int32)[:, None, None, None]
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, None, :, None]
    rows = (ids[None, :, None, :] * 2 + kv_sel) * num_kv_heads + heads    # [2, S, Hkv, nb]
    kv = jnp.take(tile_rows, rows.reshape(-1), axis=0)
    kv = kv.reshape(2, num_seq_rows, num_kv_heads, nb * block_size, head_size)
    kpos = (bidx[:, :, None] * block_size
            + jnp.arange(block_size, dtype=jnp.int32)[None, None, :]).reshape(num_seq_rows, -1)
    key_hi = seqs.pos0 + seqs.num_q
    key_lo = (jnp.zeros_like(key_hi) if sliding_window is None
              else seqs.pos0 - sliding_window + 1)
    key_ok = needed.repeat(block_size, axis=1) & (kpos < key_hi[:, None]) & (kpos >= key_lo[:, None])
    return kv, kpos, key_ok


def _attend(q, k, v, kpos, key_ok, t: tiles_lib.Tiles, *, logit_scale, sliding_window, soft_cap,
            v_scale, cdt):
    """Attention of NT tiles of ``t.tile_q`` rows against their gathered keys.

    q: [T, Hq, D] unscaled; k, v: [NT, Hkv, L, D] (v already zero where not key_ok);
    kpos, key_ok: [NT, L]. Returns [NT, Qt, Hq, D] float32.
    """
    num_tokens, num_q_heads, head_size = q.shape
    nt, num_kv_heads, kv_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    qt = t.tile_q
    rows = t.row0[:, None] + jnp.arange(qt, dtype=jnp.int32)[None, :]    # [NT, Qt]
    row_ok = jnp.arange(qt)[None, :] < t.num_q[:, None]
    qpos = t.pos0[:, None] + jnp.arange(qt, dtype=jnp.int32)[None, :]     # [NT, Qt]

    q_rows = q[jnp.clip(rows, 0, num_tokens - 1)]                         # [NT, Qt, Hq, D]
    qg = q_rows.reshape(nt, qt, num_kv_heads, group, head_size).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(nt, num_kv_heads, group * qt, head_size).astype(cdt)  # [NT, Hkv, M, D]
    # Keys on the lhs: "tksd,tkmd->tksm" ran ~8x faster than "tkmd,tksd->tkms" on XLA:CPU for
    # decode (M = G rows) and no slower for prefill tiles.
    logits = jnp.einsum("tksd,tkmd->tksm", k, qg,
                        preferred_element_type=jnp.float32) * logit_scale  # [NT, Hkv, L, M]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    mask = row_ok[:, None, :] & (kpos[:, :, None] <= qpos[:, None, :]) & key_ok[:, :, None]
    if sliding_window is not None:
        mask &= kpos[:, :, None] > qpos[:, None, :] - sliding_window
    mask = jnp.broadcast_to(mask[:, None, :, None, :], (nt, 1, kv_len, group, qt))
    mask = mask.reshape(nt, 1, kv_len, group * qt)                        # [NT, 1, L, M]
    logits = jnp.where(mask, logits, -jnp.inf)
    col_max = jnp.max(logits, axis=2, keepdims=True)
    col_max = jnp.where(jnp.isfinite(col_max), col_max, 0.0)
    p = jnp.exp(logits - col_max)                                         # masked -> exp(-inf) = 0
    denom = jnp.sum(p, axis=2)                                            # [NT, Hkv, M]
    p = jnp.swapaxes(p, 2, 3).astype(cdt)                                 # [NT, Hkv, M, L] (small)
    out = jnp.einsum("tkms,tksd->tkmd", p, v, preferred_element_type=jnp.float32)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]               # [NT, Hkv, M, D]
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    out = out.reshape(nt, num_kv_heads, group, qt, head_size).transpose(0, 3, 1, 2, 4)
    return out.reshape(nt, qt, num_q_heads, head_size)


def paged_attention_xla(q,                # [T, Hq, D]
                        kv_cache,         # [N, 2, Hkv, bs, D]
                        seq_lens,         # [S] int32
                        query_start_loc,  # [S + 1] int32
                        block_tables,     # [S, B] int32
                        num_seqs,         # [] int32
                        *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                        v_scale=None, max_q_len=None):
    """Ragged paged attention with XLA ops. Arguments as ``paged_attention`` (validated there).

    Returns [T, Hq, D] in q.dtype.
    """
    num_tokens = q.shape[0]
    num_seq_rows = seq_lens.shape[0]
    max_q = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    scale = jnp.asarray(sm_scale, jnp.float32)
    if k_scale is not None:
        scale = scale * jnp.asarray(k_scale, jnp.float32)
    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    num_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), num_seq_rows)
    cdt = compute_dtype(q.dtype, kv_cache.dtype)

    seqs = tiles_lib.sequence_tiles(seq_lens, query_start_loc, num_seqs, max_q_len=max_q)
    kv, kpos, key_ok = _gather_seq_kv(kv_cache, block_tables, seqs, sliding_window=sliding_window)
    k = kv[0].astype(cdt)                                                 # [S, Hkv, L, D]
    # Unread slots may hold NaN (null block, tails of last blocks): 0 * NaN would leak.
    v = jnp.where(key_ok[:, None, :, None], kv[1].astype(cdt), jnp.zeros((), cdt))
    attend = functools.partial(_attend, q, logit_scale=scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, v_scale=v_scale, cdt=cdt)

    out = jnp.zeros(q.shape, jnp.float32)
    dec = tiles_lib.decode_tiles(seq_lens, query_start_loc, num_seqs)
    out = tiles_lib.scatter_rows(out, attend(k, v, kpos, key_ok, dec), dec)

    tile_q = min(MAX_TILE_Q, 1 << max(0, (max_q - 2).bit_length()))      # >= max_q - 1, pow2
    bound = tiles_lib.max_prefill_tiles(num_tokens, num_seq_rows, tile_q, max_q)
    if bound:
        # Tile-count buckets 1, 4, 16, .., bound: each is one compiled branch (~0.4 s of compile
        # on XLA:CPU), so a factor of 4 keeps compiles few at <= 4x padding of the prefill part.
        sizes = [4 ** i for i in range(8) if 2 * 4 ** i <= bound] + [bound]

        def branch(n):
            def run(o, k, v, kpos, key_ok):
                t = tiles_lib.prefill_tiles(seq_lens, query_start_loc, num_seqs,
                                            tile_q=tile_q, num_tiles=n)
                tile_kv = (k[t.seq], v[t.seq], kpos[t.seq], key_ok[t.seq])   # per tile's sequence
                return tiles_lib.scatter_rows(o, attend(*tile_kv, t), t)
            return run

        _, total = tiles_lib.prefill_tile_counts(query_start_loc, num_seqs, tile_q)
        # branch 0: no prefill tiles; branch i >= 1 handles up to sizes[i - 1] tiles.
        index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), total, side="left") + 1
        index = jnp.where(total == 0, 0, index)
        out = lax.switch(index, [lambda o, *_: o] + [branch(n) for n in sizes],
                         out, k, v, kpos, key_ok)
    return out.astype(q.dtype)
