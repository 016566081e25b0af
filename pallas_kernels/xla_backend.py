"""XLA (pure-jnp) paged attention: the engine's CPU backend.

Work follows each query's own sequence (see ``tiles.py``). Two paths, each shaped for what
XLA:CPU does well (numbers: 2 cores, f32, Hkv 2, G 4, D 64, measured with jax.profiler):

* Decode tiles (every sequence's last row, M = G query rows per KV head): each row's keys are
  cut into work items of ~ITEM_KEYS keys, run W at a time (~CHUNK_BYTES of pages per
  ``fori_loop`` iteration; sizes from ``tiles.choose_tiles`` / ``tiles.decode_items``) in
  chunk-major order (every row's first item, then every row's second, ...; finished rows drop
  out), their softmax partials merged into the rows by scatter-max / scatter-add. No row waits
  in lockstep for the longest one, a single long row fills whole iterations, and rows sharing
  prefix pages read them in the same iteration. This replaced lockstep rows plus split-K for
  few rows (``benchmarks/attention_ab.py``, 8 layers,
  in one process): 256 rows of U[16, 1024) keys 1.55x faster, 8 rows U[16, 512) 1.70x,
  16 x 4k 1.04x, 64 rows U[64, 320) and 1 x 16k the same, 16 rows on one shared 8k prefix
  0.92x (row-major items instead were 0.77x there: no page reuse across rows).
  q.k / p.v are multiply + sum reductions (as batched dots they were 1.15-1.3x slower when
  XLA's loop fusions still fused the gathers into the reductions; on jax 0.10 they are YNNPACK
  reductions over gathered pages at ~10-20 GFLOP/s, which is one reason for the "cpu"
  backend's C++ kernel, ``cpu_backend.py``).
* Prefill tiles (up to ``tiles.MAX_TILE_Q`` rows of one sequence, M = G * tile_q) run ONE
  AFTER ANOTHER, each over its own keys in chunks (``tiles.prefill_keys_for``): the trip count
  of a tile is its own block count (the causal triangle, chunk-granular) and its [Hkv, G, Qt, L]
  logits stay in cache. Big tiles make big dots: [1024 x 64] x [64 x 256] batched dots ran at ~180 GFLOP/s vs
  ~85 for 64-row tiles.

Two rules that decide the speed on XLA:CPU:
* Key positions of a chunk are CONTIGUOUS (``k0 + iota``): blocks of a chunk are consecutive
  table columns. Masks are then compares of two iotas, which XLA vectorises. Building them from
  ``block * bs + offset`` reshaped to [C * bs] put a div/mod per logit into the exp fusion and
  made it ~10x slower (5 ns vs 0.5 ns per logit; the whole prefill call 43 ms -> 21 ms).
* Gather indices are computed BEFORE the loop (one small int32 array per chunk), so the gather
  fusion reads an index instead of recomputing a table lookup per gathered byte.

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

from jaxkv.pallas_kernels import tiles as tiles_lib
from jaxkv.pallas_kernels.layout import bytes_to_typed, compute_dtype
from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID


def _page_rows(
    ids,  # [..., C] int32 block ids
    num_kv_heads: int,
):
    """Row indices of (block, K|V, head) in the [N * 2 * Hkv, bs * D'] row view: [2, ..., Hkv, C]."""
    c = jnp.arange(2, dtype=jnp.int32).reshape((2,) + (1,) * ids.ndim)
    h = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None]
    return (ids[None, ..., None, :] * 2 + c[..., None]) * num_kv_heads + h


def _table_ids(
    tables,  # [R, B] int32 block tables
    rows,  # [...] int32 table row of each entry
    cols,  # [...] int32 table column (may be past the table)
    ok,
):  # [...] bool: the entry is one of its row's blocks
    """Block ids at (rows, cols): NULL_BLOCK_ID where not ``ok``, never a garbage entry."""
    return jnp.where(ok, tables[rows, jnp.minimum(cols, tables.shape[1] - 1)], NULL_BLOCK_ID)


def _chunk_rows(
    tables,  # [R, B] int32 block-table rows
    first,
    end,  # [R] int32 block range [first, end) of each row
    num_chunks: int,
    chunk: int,
    num_kv_heads: int,
):
    """Gather rows of every chunk of C blocks, computed once before the loop: [n, 2, R, Hkv, C].

    Columns past ``end`` (or past the table) read NULL_BLOCK_ID, never a garbage entry.
    """
    num_rows = tables.shape[0]
    cols = first[:, None] + jnp.arange(num_chunks * chunk, dtype=jnp.int32)[None, :]  # [R, n*C]
    ids = _table_ids(
        tables, jnp.arange(num_rows, dtype=jnp.int32)[:, None], cols, cols < end[:, None]
    ).reshape(num_rows, num_chunks, chunk)
    return _page_rows(ids, num_kv_heads).transpose(2, 0, 1, 3, 4)


def _gather_kv(
    kv_rows,  # [N * 2 * Hkv, bs * D'] typed or uint8
    rows,  # [2, ..., Hkv, C] int32
    kv_dtype,
    block_size: int,
):
    """Pages of ``rows`` as typed K/V: [2, ..., Hkv, C * bs, D]."""
    lead = rows.shape[:-1]
    kv = jnp.take(kv_rows, rows.reshape(-1), axis=0)
    kv = kv.reshape(*lead, rows.shape[-1] * block_size, -1)
    return kv if kv_dtype is None else bytes_to_typed(kv, kv_dtype)


def _q_tile(q, rows, *, num_kv_heads, cdt):
    """q [T, Hq, D] at ``rows`` [..., Qt] -> [..., Hkv, G, Qt, D] in cdt."""
    num_tokens, num_q_heads, head_size = q.shape
    group = num_q_heads // num_kv_heads
    x = q[jnp.clip(rows, 0, num_tokens - 1)]
    x = x.reshape(*rows.shape, num_kv_heads, group, head_size)
    nd = rows.ndim
    perm = tuple(range(nd - 1)) + (nd, nd + 1, nd - 1, nd + 2)
    return x.transpose(perm).astype(cdt)


def _softmax_step(carry, logits, ok, pv_of, *, logit_scale, soft_cap):
    """One online-softmax update. logits [..., L] f32 (unscaled); ``ok`` masks keys;
    ``pv_of(p)`` is p [..., L] times this chunk's V (whose masked rows are zero)."""
    m, l, acc = carry
    logits = logits * logit_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(ok, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(logits - m_safe[..., None])  # masked -> 0
    corr = jnp.exp(m - m_safe)
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv_of(p)


def _decode_attention(
    q,
    kv_rows,
    block_tables,
    t: tiles_lib.Tiles,
    launch: tiles_lib.LaunchTiles,
    *,
    block_size,
    num_kv_heads,
    kv_dtype,
    logit_scale,
    sliding_window,
    soft_cap,
):
    """Attention of the S one-row decode tiles. Returns [S, Hkv, G, D] f32 (rows are divided
    by their softmax sum; empty tiles give zeros).

    Each row's keys are cut into work items of C blocks, processed W per iteration in
    chunk-major order (no row idles while a longer one finishes, one long row fills whole
    iterations, and rows sharing prefix pages read them together). An item's softmax partials
    (max, sum, p.v) are merged into its row's running state by scatter-max / scatter-add
    (items past the total are dropped).
    """
    num_q_heads, head_size = q.shape[1:]
    group = num_q_heads // num_kv_heads
    nt = t.num_tiles
    max_blocks = block_tables.shape[1]
    qg = _q_tile(q, t.row0[:, None], num_kv_heads=num_kv_heads, cdt=jnp.float32)
    qg = qg.reshape(nt, num_kv_heads, group, head_size)  # [S, Hkv, G, D]

    first, end, bound = tiles_lib.kv_block_range(
        t, block_size=block_size, max_blocks=max_blocks, sliding_window=sliding_window
    )
    key_lo, key_hi = tiles_lib.key_range(t, sliding_window=sliding_window)
    key_hi = jnp.minimum(key_hi, end * block_size)  # [S] exclusive
    c, w = launch.pages_per_tile, launch.items_per_step  # tiles.decode_items
    n_items = (end - first + c - 1) // c  # [S] (0: empty tile)
    levels = -(-bound // c)  # static items per row
    # Items in chunk-major order: every row's item 0, then every row's item 1, ... (rows with
    # fewer items drop out): rows reading shared pages (a common prefix) read them in the same
    # iteration. Rows are ranked by item count so the rows still active at a level are a prefix.
    perm = jnp.argsort(-n_items, stable=True).astype(jnp.int32)  # [S]
    active = jnp.sum(n_items[None, :] > jnp.arange(levels, dtype=jnp.int32)[:, None], axis=1)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(active).astype(jnp.int32)])
    total = starts[-1]
    n_static = -(-(nt * levels) // w)  # static iteration bound
    item = jnp.arange(n_static * w, dtype=jnp.int32)  # [I]
    level = jnp.clip(jnp.searchsorted(starts, item, side="right") - 1, 0, levels - 1)
    r = perm[jnp.clip(item - starts[level], 0, nt - 1)]  # [I] its row
    valid = item < total
    blk0 = first[r] + level * c  # [I] first block
    cols = blk0[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]  # [I, C]
    ids = _table_ids(
        block_tables, t.seq[r][:, None], cols, valid[:, None] & (cols < end[r][:, None])
    )  # [I, C]
    rows_all = _page_rows(ids.reshape(n_static, w, c), num_kv_heads)  # [2, n, W, Hkv, C]
    rows_all = rows_all.transpose(1, 0, 2, 3, 4)  # [n, 2, W, Hkv, C]
    kp0 = (blk0 * block_size).reshape(n_static, w)  # [n, W]
    hi = jnp.where(valid, key_hi[r], 0).reshape(n_static, w)  # [n, W]
    lo = key_lo[r].reshape(n_static, w)
    row = r.reshape(n_static, w)  # [n, W] for q and m
    rid = jnp.where(valid, r, nt).reshape(n_static, w)  # [n, W] S: dropped
    iota = jnp.arange(c * block_size, dtype=jnp.int32)

    def body(j, carry):
        m_run, l_run, acc_run = carry  # [S, Hkv, G(, D)]
        kp = kp0[j][:, None] + iota[None, :]  # [W, L] contiguous
        ok = (kp < hi[j][:, None]) & (kp >= lo[j][:, None])
        # K and V are gathered separately and reduced with multiply + sum (no dots): with
        # XLA's loop fusions each gather fused into its reduction (1.15-1.3x faster than dots
        # on CPU); jax 0.10's YNNPACK reductions take the gathered pages as a separate fusion.
        k = _gather_kv(kv_rows, rows_all[j, 0], kv_dtype, block_size).astype(jnp.float32)
        v = _gather_kv(kv_rows, rows_all[j, 1], kv_dtype, block_size).astype(jnp.float32)
        rj = row[j]
        logits = jnp.sum(k[:, :, None] * qg[rj][:, :, :, None, :], axis=-1)  # [W, Hkv, G, L]
        v = jnp.where(ok[:, None, :, None], v, 0.0)  # [W, Hkv, L, D]
        empty = (
            jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32),
            jnp.zeros(logits.shape[:-1], jnp.float32),
            jnp.zeros(logits.shape[:-1] + (head_size,), jnp.float32),
        )
        m_i, l_i, acc_i = _softmax_step(
            empty,
            logits,
            ok[:, None, None, :],
            lambda p: jnp.sum(p[..., None] * v[:, :, None], axis=3),
            logit_scale=logit_scale,
            soft_cap=soft_cap,
        )
        # Merge the items into their rows (several items of one row may share an iteration).
        m_new = m_run.at[rid[j]].max(m_i, mode="drop")  # [S, Hkv, G]
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        wi = jnp.exp(m_i - m_safe[rj])  # [W, Hkv, G]
        corr = jnp.exp(m_run - m_safe)
        l_run = (l_run * corr).at[rid[j]].add(l_i * wi, mode="drop")
        acc_run = (acc_run * corr[..., None]).at[rid[j]].add(acc_i * wi[..., None], mode="drop")
        return m_new, l_run, acc_run

    init = (
        jnp.full((nt, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((nt, num_kv_heads, group), jnp.float32),
        jnp.zeros((nt, num_kv_heads, group, head_size), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, (total + w - 1) // w, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _prefill_attention(
    out,  # [T + Qt, Hq, D] f32 (rows past T absorb a tile's overhang)
    q,
    kv_rows,
    block_tables,
    t: tiles_lib.Tiles,
    launch: tiles_lib.LaunchTiles,
    *,
    block_size,
    num_kv_heads,
    kv_dtype,
    logit_scale,
    sliding_window,
    soft_cap,
):
    """Prefill tiles one after another, each over its own keys; writes their rows into ``out``."""
    num_q_heads, head_size = q.shape[1:]
    group = num_q_heads // num_kv_heads
    qt = t.tile_q
    max_blocks = block_tables.shape[1]
    cache_dtype = kv_rows.dtype if kv_dtype is None else kv_dtype
    cdt = compute_dtype(q.dtype, cache_dtype)
    first, end, bound = tiles_lib.kv_block_range(
        t, block_size=block_size, max_blocks=max_blocks, sliding_window=sliding_window
    )
    chunk = launch.pages_per_tile  # tiles.prefill_keys_for(qt) keys, within the bound
    lk = chunk * block_size
    qoff = jnp.arange(qt, dtype=jnp.int32)
    iota = jnp.arange(lk, dtype=jnp.int32)
    num_real = jnp.sum((t.num_q > 0).astype(jnp.int32))  # real tiles come first

    def tile_body(i, out):
        row0, nq, pos0, f, e = t.row0[i], t.num_q[i], t.pos0[i], first[i], end[i]
        qg = _q_tile(q, row0 + qoff, num_kv_heads=num_kv_heads, cdt=cdt)  # [Hkv, G, Qt, D]
        qpos = (pos0 + qoff)[:, None]  # [Qt, 1]
        row_ok = (qoff < nq)[:, None]
        key_hi = jnp.minimum(pos0 + nq, e * block_size)
        n_tile = (e - f + chunk - 1) // chunk
        rows_all = _chunk_rows(
            block_tables[t.seq[i]][None], f[None], e[None], -(-bound // chunk), chunk, num_kv_heads
        )[:, :, 0]  # [n, 2, Hkv, C]

        def body(j, carry):
            kv = _gather_kv(kv_rows, rows_all[j], kv_dtype, block_size)  # [2, Hkv, L, D]
            kp = (f + j * chunk) * block_size + iota  # [L] contiguous
            key_ok = kp < key_hi
            ok = row_ok & key_ok[None, :] & (kp[None, :] <= qpos)  # [Qt, L]
            if sliding_window is not None:
                ok &= kp[None, :] > qpos - sliding_window
            k = kv[0].astype(cdt)
            v = jnp.where(key_ok[None, :, None], kv[1].astype(cdt), jnp.zeros((), cdt))
            logits = jnp.einsum("kgqd,ksd->kgqs", qg, k, preferred_element_type=jnp.float32)
            return _softmax_step(
                carry,
                logits,
                ok,
                lambda p: jnp.einsum(
                    "kgqs,ksd->kgqd", p.astype(cdt), v, preferred_element_type=jnp.float32
                ),
                logit_scale=logit_scale,
                soft_cap=soft_cap,
            )

        init = (
            jnp.full((num_kv_heads, group, qt), -jnp.inf, jnp.float32),
            jnp.zeros((num_kv_heads, group, qt), jnp.float32),
            jnp.zeros((num_kv_heads, group, qt, head_size), jnp.float32),
        )
        _, l, acc = lax.fori_loop(0, n_tile, body, init)
        res = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [Hkv, G, Qt, D]
        res = res.transpose(2, 0, 1, 3).reshape(qt, num_q_heads, head_size)
        old = lax.dynamic_slice_in_dim(out, row0, qt)
        # Rows past the tile's own (num_q) keep what is there: the next tile or sequence owns them.
        return lax.dynamic_update_slice_in_dim(
            out, jnp.where(row_ok[:, :, None], res, old), row0, 0
        )

    return lax.fori_loop(0, num_real, tile_body, out)


def paged_attention_xla(
    q,  # [T, Hq, D]
    kv_cache,  # [N, 2, Hkv, bs, D] typed, or [.., D * isz] uint8 bytes
    seq_lens,  # [S] int32
    query_start_loc,  # [S + 1] int32
    block_tables,  # [S, B] int32
    num_seqs,  # [] int32
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    max_q_len=None,
    kv_dtype=None,
):
    """Ragged paged attention with XLA ops. Arguments as ``paged_attention`` (validated there).

    Prefill tiles run in a loop over the real ones, so their static bound (from T, S and
    max_q_len) costs only their metadata: no per-step tile count is needed (or compiled for).
    Returns [T, Hq, D] in q.dtype.
    """
    num_tokens, num_q_heads, head_size = q.shape
    num_blocks, _, num_kv_heads, block_size, row_width = kv_cache.shape
    num_seq_rows, max_blocks = block_tables.shape
    cfg = tiles_lib.choose_tiles(
        "xla",
        num_tokens=num_tokens,
        num_seq_rows=num_seq_rows,
        max_blocks=max_blocks,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        max_q_len=max_q_len,
        sliding_window=sliding_window,
        cache_dtype=kv_cache.dtype if kv_dtype is None else kv_dtype,
    )
    scale = jnp.asarray(sm_scale, jnp.float32)
    if k_scale is not None:
        scale = scale * jnp.asarray(k_scale, jnp.float32)
    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    num_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), num_seq_rows)
    # (block, K|V, head) rows: contiguous [bs * D'] runs of the page-major cache.
    kv_rows = kv_cache.reshape(num_blocks * 2 * num_kv_heads, block_size * row_width)
    common = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        kv_dtype=kv_dtype,
        logit_scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )

    pre = cfg.prefill
    out = jnp.zeros((num_tokens + (pre.tile_q if pre else 0), num_q_heads, head_size), jnp.float32)
    if pre is not None:
        t = tiles_lib.prefill_tiles(
            seq_lens, query_start_loc, num_seqs, tile_q=pre.tile_q, num_tiles=pre.num_tiles
        )
        out = _prefill_attention(out, q, kv_rows, block_tables, t, pre, **common)
    dec = tiles_lib.decode_tiles(seq_lens, query_start_loc, num_seqs)
    res = _decode_attention(q, kv_rows, block_tables, dec, cfg.decode, **common)  # [S, Hkv, G, D]
    out = tiles_lib.scatter_rows(out, res.reshape(num_seq_rows, 1, num_q_heads, head_size), dec)
    out = out[:num_tokens]
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    return out.astype(q.dtype)
