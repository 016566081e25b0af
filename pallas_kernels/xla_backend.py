"""XLA (pure-jnp) paged attention: the engine's CPU backend.

Work is proportional to each query's own sequence (see ``tiles.py``): every sequence's last
query row is a "decode tile" of one row; the remaining rows of prefill chunks are cut into
"prefill tiles" of ``tile_q`` rows. Each tile walks ITS OWN blocks in chunks of a few blocks
with an online softmax, in a ``fori_loop`` whose trip count is the longest tile's block count
at run time:

    for chunk j:  ids = block_table[seq, first + j*C : first + (j+1)*C]   # [NT, C]
                  K, V = gather the (block, K|V, head) rows of ids         # [NT, Hkv, C*bs, D]
                  m, l, acc = online-softmax update with the masked logits

Why a loop and not one gather of every sequence's whole table row: measured on XLA:CPU (2
cores, f32, 64 decode rows x 32 blocks of 16, Hkv 2, D 64) the big gather materialises 32 MB
and the call took 28 ms; walking 2 blocks at a time keeps each gathered chunk in cache and
took 4 ms, and its trip count follows the real context length, not the table's bucket.

The cache can be given as bytes (``kv_dtype`` set, [N, 2, Hkv, bs, D * itemsize] uint8): the
gather then reads bytes and only the gathered chunk is bitcast. This matters on XLA:CPU, where
a size-changing bitcast of the whole buffer is expanded into an elementwise pass that is
materialised (a full cache copy per call) when its consumer sits inside a loop.

Block-table entries nobody needs are replaced by NULL_BLOCK_ID before the gather (they may be
garbage), and V rows outside a tile's keys are zeroed (pages may hold NaN; 0 * NaN = NaN).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiles as tiles_lib
from pallas_kernels.layout import bytes_to_typed, compute_dtype
from pallas_kernels.metadata import NULL_BLOCK_ID

#: Rows per prefill tile (upper bound; smaller when max_q_len is small).
MAX_TILE_Q = 64
#: Bytes of K/V one loop iteration gathers over all tiles. Fewer, bigger iterations amortise
#: the loop's per-iteration cost (dominant for few long sequences); smaller chunks stay in cache
#: (better for many sequences). Measured on 2 CPU cores (f32, Hkv 2, D 64, decode), 4 MiB vs
#: 1 MiB per iteration: 1.26x faster at 1 row x 16k keys, 1.37x at 16 x 4k, 1.24x at 64 x 300;
#: 8 MiB was no better.
CHUNK_BYTES = 4 << 20
MAX_CHUNK_KEYS = 1024


def chunk_keys_for(num_tiles: int, num_kv_heads: int, head_size: int, itemsize: int,
                   block_size: int) -> int:
    """Keys per iteration: a power of two with ~CHUNK_BYTES gathered, in [block_size, 1024]."""
    per_key = max(1, num_tiles * 2 * num_kv_heads * head_size * itemsize)
    keys = max(1, CHUNK_BYTES // per_key)
    keys = 1 << (keys.bit_length() - 1)
    return max(block_size, min(MAX_CHUNK_KEYS, keys))


def _attend_tiles(q, kv_rows, block_tables, t: tiles_lib.Tiles, *, block_size, num_kv_heads,
                  head_size, kv_dtype, logit_scale, sliding_window, soft_cap, v_scale):
    """Attention of NT tiles of ``t.tile_q`` rows, each against its own sequence's keys.

    q: [T, Hq, D] unscaled; kv_rows: [N * 2 * Hkv, bs * D'] (typed rows, D' = D, or bytes,
    D' = D * itemsize, when kv_dtype is not None); block_tables: [S, B].
    Returns [NT, Qt, Hq, D] float32.
    """
    num_tokens, num_q_heads, _ = q.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    nt, qt = t.num_tiles, t.tile_q
    m_rows = group * qt
    cache_dtype = kv_rows.dtype if kv_dtype is None else kv_dtype
    cdt = compute_dtype(q.dtype, cache_dtype)

    rows = t.row0[:, None] + jnp.arange(qt, dtype=jnp.int32)[None, :]    # [NT, Qt]
    row_ok = jnp.arange(qt)[None, :] < t.num_q[:, None]
    qpos = t.pos0[:, None] + jnp.arange(qt, dtype=jnp.int32)[None, :]     # [NT, Qt]
    q_rows = q[jnp.clip(rows, 0, num_tokens - 1)]                         # [NT, Qt, Hq, D]
    qg = q_rows.reshape(nt, qt, num_kv_heads, group, head_size).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(nt, num_kv_heads, m_rows, head_size).astype(cdt)      # [NT, Hkv, M, D]

    first, end, bound = tiles_lib.kv_block_range(t, block_size=block_size, max_blocks=max_blocks,
                                                 sliding_window=sliding_window)
    # C blocks per iteration: ~CHUNK_BYTES gathered, never more than a tile can need.
    chunk = min(bound, chunk_keys_for(nt, num_kv_heads, head_size, jnp.dtype(cache_dtype).itemsize,
                                      block_size) // block_size)
    key_hi = t.pos0 + t.num_q                                             # [NT] exclusive
    key_lo = (jnp.zeros_like(key_hi) if sliding_window is None
              else t.pos0 - sliding_window + 1)
    tables = block_tables[t.seq]                                          # [NT, B]
    num_chunks = (jnp.max(end - first) + chunk - 1) // chunk
    kv_sel = jnp.arange(2, dtype=jnp.int32)[:, None, None, None]          # [2, 1, 1, 1]
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, None, :, None]
    offs = jnp.arange(block_size, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        cols = first[:, None] + j * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [NT, C]
        blk_ok = cols < end[:, None]
        ids = jnp.where(blk_ok, jnp.take_along_axis(tables, jnp.minimum(cols, max_blocks - 1), axis=1),
                        NULL_BLOCK_ID)
        sel = (ids[None, :, None, :] * 2 + kv_sel) * num_kv_heads + heads  # [2, NT, Hkv, C]
        kv = jnp.take(kv_rows, sel.reshape(-1), axis=0)                   # [2*NT*Hkv*C, bs*D']
        kv = kv.reshape(2, nt, num_kv_heads, chunk * block_size, -1)
        if kv_dtype is not None:
            kv = bytes_to_typed(kv, kv_dtype)                             # [2, NT, Hkv, C*bs, D]
        kpos = (cols[:, :, None] * block_size + offs).reshape(nt, chunk * block_size)  # [NT, L]
        key_ok = (jnp.repeat(blk_ok, block_size, axis=1) & (kpos < key_hi[:, None])
                  & (kpos >= key_lo[:, None]))
        k = kv[0].astype(cdt)
        v = jnp.where(key_ok[:, None, :, None], kv[1].astype(cdt), jnp.zeros((), cdt))
        # Keys on the lhs ("tksd,tkmd->tksm") ran ~8x faster than "tkmd,tksd->tkms" on XLA:CPU.
        logits = jnp.einsum("tksd,tkmd->tksm", k, qg,
                            preferred_element_type=jnp.float32) * logit_scale  # [NT, Hkv, L, M]
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        mask = row_ok[:, None, :] & (kpos[:, :, None] <= qpos[:, None, :]) & key_ok[:, :, None]
        if sliding_window is not None:
            mask &= kpos[:, :, None] > qpos[:, None, :] - sliding_window
        mask = jnp.broadcast_to(mask[:, None, :, None, :], (nt, 1, chunk * block_size, group, qt))
        logits = jnp.where(mask.reshape(nt, 1, chunk * block_size, m_rows), logits, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=2))                   # [NT, Hkv, M]
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - m_safe[:, :, None, :])                       # masked -> 0
        corr = jnp.exp(m - m_safe)
        l = l * corr + jnp.sum(p, axis=2)
        pv = jnp.einsum("tksm,tksd->tkmd", p.astype(cdt), v, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[..., None] + pv

    init = (jnp.full((nt, num_kv_heads, m_rows), -jnp.inf, jnp.float32),
            jnp.zeros((nt, num_kv_heads, m_rows), jnp.float32),
            jnp.zeros((nt, num_kv_heads, m_rows, head_size), jnp.float32))
    _, l, acc = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]                       # [NT, Hkv, M, D]
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    out = out.reshape(nt, num_kv_heads, group, qt, head_size).transpose(0, 3, 1, 2, 4)
    return out.reshape(nt, qt, num_q_heads, head_size)


def paged_attention_xla(q,                # [T, Hq, D]
                        kv_cache,         # [N, 2, Hkv, bs, D] typed, or [.., D * isz] uint8 bytes
                        seq_lens,         # [S] int32
                        query_start_loc,  # [S + 1] int32
                        block_tables,     # [S, B] int32
                        num_seqs,         # [] int32
                        *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                        v_scale=None, max_q_len=None, kv_dtype=None, num_prefill_tiles=None):
    """Ragged paged attention with XLA ops. Arguments as ``paged_attention`` (validated there).

    ``num_prefill_tiles`` (static): how many prefill tiles to compute (the caller's exact,
    bucketed count from :func:`tiles.plan_prefill_tiles`); None = the static upper bound.
    Returns [T, Hq, D] in q.dtype.
    """
    num_tokens, _, head_size = q.shape
    num_blocks, _, num_kv_heads, block_size, row_width = kv_cache.shape
    num_seq_rows = seq_lens.shape[0]
    max_q = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    scale = jnp.asarray(sm_scale, jnp.float32)
    if k_scale is not None:
        scale = scale * jnp.asarray(k_scale, jnp.float32)
    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    num_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), num_seq_rows)
    # (block, K|V, head) rows: contiguous [bs * D'] runs of the page-major cache.
    kv_rows = kv_cache.reshape(num_blocks * 2 * num_kv_heads, block_size * row_width)
    common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                  kv_dtype=kv_dtype, logit_scale=scale, sliding_window=sliding_window,
                  soft_cap=soft_cap, v_scale=v_scale)

    out = jnp.zeros(q.shape, jnp.float32)
    dec = tiles_lib.decode_tiles(seq_lens, query_start_loc, num_seqs)
    out = tiles_lib.scatter_rows(
        out, _attend_tiles(q, kv_rows, block_tables, dec, **common), dec)

    tile_q = tiles_lib.prefill_tile_q(max_q, MAX_TILE_Q)
    bound = tiles_lib.max_prefill_tiles(num_tokens, num_seq_rows, tile_q, max_q)
    n = bound if num_prefill_tiles is None else min(num_prefill_tiles, bound)
    if n > 0:
        t = tiles_lib.prefill_tiles(seq_lens, query_start_loc, num_seqs, tile_q=tile_q, num_tiles=n)
        out = tiles_lib.scatter_rows(
            out, _attend_tiles(q, kv_rows, block_tables, t, **common), t)
    return out.astype(q.dtype)
