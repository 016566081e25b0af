"""XLA (pure-jnp, gather-based) paged attention: the engine's CPU backend.

Work is proportional to each query's own sequence (see ``tiles.py``):
  * decode tiles: the last query row of every sequence attends its own gathered blocks
    ([S, Hkv, G, 1] x [S, Hkv, L, D]) -- a pure-decode batch is only this;
  * prefill tiles: the remaining rows, ``tile_q`` at a time; their count is bucketed to a power
    of two at run time and ``lax.switch`` runs the one branch of that static size, so a batch
    of many decodes and one prefill chunk never pads every sequence to the chunk length.
With a sliding window each tile gathers only the blocks its window can touch.

Block-table entries a tile does not need are replaced by NULL_BLOCK_ID before the gather (they
may be garbage), and V rows outside the needed key range are zeroed (the page may hold NaN and
0 * NaN = NaN).

einsum order: batch dims first and the contraction output kept as ``[tile, Hkv, rows, D]`` then
transposed (DESIGN.md 6: ``->bkgtd`` + transpose was 10x faster than ``->btkgd`` on XLA:CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiles as tiles_lib
from pallas_kernels.metadata import NULL_BLOCK_ID

#: Rows per prefill tile (upper bound; smaller when max_q_len is small).
MAX_TILE_Q = 64


def _attend_tiles(q, kv_cache, block_tables, t: tiles_lib.Tiles, *, sliding_window, soft_cap,
                  v_scale):
    """Attention of NT tiles of ``t.tile_q`` rows: returns [NT, Qt, Hq, D] float32.

    q: [T, Hq, D] float32, already multiplied by sm_scale * k_scale.
    kv_cache: [N, 2, Hkv, bs, D]; block_tables: [S, B] int32.
    """
    num_tokens, num_q_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    nt, qt = t.num_tiles, t.tile_q

    first, end, nb = tiles_lib.kv_block_range(t, block_size=block_size, max_blocks=max_blocks,
                                              sliding_window=sliding_window)
    bidx = first[:, None] + jnp.arange(nb, dtype=jnp.int32)[None, :]     # [NT, nb]
    needed = bidx < end[:, None]
    ids = jnp.where(needed, block_tables[t.seq[:, None], jnp.minimum(bidx, max_blocks - 1)],
                    NULL_BLOCK_ID)
    # Gather (block, K|V, head) tiles straight into [NT, Hkv, nb, bs, D]: measured 2x faster on
    # XLA:CPU than gathering whole pages and transposing them (one pass over the KV, not three).
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    k = kv_cache[ids[:, None, :], 0, heads].reshape(nt, num_kv_heads, nb * block_size, head_size)
    v = kv_cache[ids[:, None, :], 1, heads].reshape(nt, num_kv_heads, nb * block_size, head_size)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)                   # [NT, Hkv, L, D]

    rows = t.row0[:, None] + jnp.arange(qt, dtype=jnp.int32)[None, :]    # [NT, Qt]
    row_ok = jnp.arange(qt)[None, :] < t.num_q[:, None]
    qpos = t.pos0[:, None] + jnp.arange(qt, dtype=jnp.int32)[None, :]     # [NT, Qt]
    kpos = (bidx[:, :, None] * block_size
            + jnp.arange(block_size, dtype=jnp.int32)[None, None, :]).reshape(nt, -1)  # [NT, L]
    key_hi = t.pos0 + t.num_q
    key_lo = (jnp.zeros_like(key_hi) if sliding_window is None
              else t.pos0 - sliding_window + 1)
    key_ok = needed.repeat(block_size, axis=1) & (kpos < key_hi[:, None]) & (kpos >= key_lo[:, None])
    v = jnp.where(key_ok[:, None, :, None], v, 0.0)

    qt_rows = q[jnp.clip(rows, 0, num_tokens - 1)]                        # [NT, Qt, Hq, D]
    qg = qt_rows.reshape(nt, qt, num_kv_heads, group, head_size).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(nt, num_kv_heads, group * qt, head_size)              # [NT, Hkv, G*Qt, D]
    logits = jnp.einsum("tkmd,tksd->tkms", qg, k)                         # [NT, Hkv, G*Qt, L]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    mask = row_ok[:, :, None] & (kpos[:, None, :] <= qpos[:, :, None]) & key_ok[:, None, :]
    if sliding_window is not None:
        mask &= kpos[:, None, :] > qpos[:, :, None] - sliding_window
    mask = jnp.broadcast_to(mask[:, None, None], (nt, 1, group, qt, mask.shape[-1]))
    mask = mask.reshape(nt, 1, group * qt, -1)                            # [NT, 1, G*Qt, L]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - row_max)                                         # masked -> exp(-inf) = 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tkms,tksd->tkmd", p, v)                             # [NT, Hkv, G*Qt, D]
    out = out / jnp.where(denom > 0, denom, 1.0)
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    out = out.reshape(nt, num_kv_heads, group, qt, head_size).transpose(0, 3, 1, 2, 4)
    return out.reshape(nt, qt, num_q_heads, head_size)


def paged_attention_xla(q, kv_cache, seq_lens, query_start_loc, block_tables, num_seqs, *,
                        sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                        v_scale=None, max_q_len=None):
    """Ragged paged attention with XLA ops. Arguments as ``paged_attention`` (validated there).

    q: [T, Hq, D]; kv_cache: [N, 2, Hkv, bs, D]; seq_lens: [S]; query_start_loc: [S + 1];
    block_tables: [S, B]; num_seqs: []. Returns [T, Hq, D] in q.dtype.
    """
    num_tokens = q.shape[0]
    num_seq_rows = seq_lens.shape[0]
    max_q = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    scale = jnp.asarray(sm_scale, jnp.float32)
    if k_scale is not None:
        scale = scale * jnp.asarray(k_scale, jnp.float32)
    qf = q.astype(jnp.float32) * scale
    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    num_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), num_seq_rows)
    attend = lambda t: _attend_tiles(qf, kv_cache, block_tables, t, sliding_window=sliding_window,
                                     soft_cap=soft_cap, v_scale=v_scale)

    out = jnp.zeros(qf.shape, jnp.float32)
    dec = tiles_lib.decode_tiles(seq_lens, query_start_loc, num_seqs)
    out = tiles_lib.scatter_rows(out, attend(dec), dec)

    tile_q = min(MAX_TILE_Q, 1 << max(0, (max_q - 2).bit_length()))      # >= max_q - 1, pow2
    bound = tiles_lib.max_prefill_tiles(num_tokens, num_seq_rows, tile_q, max_q)
    if bound:
        # Tile-count buckets 1, 4, 16, .., bound: each is one compiled branch (~0.4 s of compile
        # on XLA:CPU), so a factor of 4 keeps compiles few at <= 4x padding of the prefill part.
        sizes = [4 ** i for i in range(8) if 4 ** i < bound] + [bound]

        def branch(n):
            def run(o):
                t = tiles_lib.prefill_tiles(seq_lens, query_start_loc, num_seqs,
                                            tile_q=tile_q, num_tiles=n)
                return tiles_lib.scatter_rows(o, attend(t), t)
            return run

        _, total = tiles_lib.prefill_tile_counts(query_start_loc, num_seqs, tile_q)
        # branch 0: no prefill tiles; branch i >= 1 handles up to sizes[i - 1] tiles.
        index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), total, side="left") + 1
        index = jnp.where(total == 0, 0, index)
        out = lax.switch(index, [lambda o: o] + [branch(n) for n in sizes], out)
    return out.astype(q.dtype)
