"""``backend="pallas"``: tiles the ragged batch (``tiles.py``) and runs the GPU or TPU kernel.

Lowering-neutral glue: takes the tile sizes from ``tiles.choose_tiles``, builds the per-tile
metadata (``tiles.tile_meta``), packs query rows into [NT, Hkv, M, D] tiles,
combines KV splits and scatters rows back. The kernels live in ``triton_backend.py`` (GPU,
``lowering="triton"``) and ``mosaic_backend.py`` (TPU, ``lowering="mosaic"``); ``lowering=None``
picks by ``jax.default_backend()`` (Mosaic on TPU, else Triton).

Decode tiles (the last row of each sequence) run with KV splits (flash-decoding) when there
are too few (sequence, KV head) programs to fill the GPU; prefill tiles run with a static tile
count bound (empty tiles exit at once: cheaper on a GPU than a data-dependent branch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.pallas_kernels import mosaic_backend, triton_backend
from jaxkv.pallas_kernels import tiles as tiles_lib
from jaxkv.pallas_kernels.layout import check_word_layout, resolve_kv_dtype
from jaxkv.pallas_kernels.layout import compute_dtype as compute_dtype_for
from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID
from jaxkv.pallas_kernels.tiles import TARGET_ROWS
from jaxkv.pallas_kernels.validation import resolve_lowering, validate_attention_args


def _pack_q(q, t: tiles_lib.Tiles, num_kv_heads: int, rows: int):
    """q [T, Hq, D] -> [NT, Hkv, M, D]: row r of a tile = token r // G, query head r % G."""
    num_tokens, num_q_heads, head_size = q.shape
    group = num_q_heads // num_kv_heads
    idx = jnp.clip(t.row0[:, None] + jnp.arange(t.tile_q)[None, :], 0, num_tokens - 1)
    qt = q[idx].reshape(t.num_tiles, t.tile_q, num_kv_heads, group, head_size)
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(t.num_tiles, num_kv_heads, t.tile_q * group, head_size)
    return jnp.pad(qt, ((0, 0), (0, 0), (0, rows - t.tile_q * group), (0, 0)))


def _unpack_out(o, t: tiles_lib.Tiles, num_q_heads: int):
    """[NT, Hkv, M, D] -> [NT, Qt, Hq, D] (inverse of _pack_q)."""
    nt, num_kv_heads, _, head_size = o.shape
    group = num_q_heads // num_kv_heads
    o = o[:, :, : t.tile_q * group].reshape(nt, num_kv_heads, t.tile_q, group, head_size)
    return o.transpose(0, 2, 1, 3, 4).reshape(nt, t.tile_q, num_q_heads, head_size)


def _combine_splits(o, m, l):
    """Merges KV splits: o [P, ...,M, D] (each normalised), m, l [P, ..., M] -> [..., M, D]."""
    if o.shape[0] == 1:
        return o[0]
    m_all = jnp.max(m, axis=0)
    w = l * jnp.exp(m - m_all[None])  # [P, ..., M]
    denom = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o, axis=0)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def paged_attention_pallas(
    q,  # [T, Hq, D]
    kv_cache,  # [N, 2, Hkv, bs, D]
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
    interpret=False,
    lowering=None,
    kv_splits=None,
    kv_tile_tokens=None,
    target_rows=TARGET_ROWS,
):
    """Arguments as ``paged_attention`` (validated there) plus tuning knobs; [T, Hq, D] q.dtype.

    lowering: "triton" | "mosaic" | None (by platform). kv_splits: KV splits of decode tiles
    (None = pick from the program count; 1 in interpret mode; Triton only). kv_tile_tokens: keys
    per inner-loop step (None: 64 Triton, 128 Mosaic). target_rows: query rows per prefill tile.
    The tile sizes are ``tiles.choose_tiles``'.
    """
    num_tokens, num_q_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    num_seq_rows, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    mosaic = resolve_lowering(lowering, interpret) == "mosaic"
    if mosaic:
        mosaic_backend.check_shapes(head_size=head_size, block_size=block_size)
    compute_dtype = compute_dtype_for(q.dtype, kv_cache.dtype)
    cfg = tiles_lib.choose_tiles(
        "mosaic" if mosaic else "triton",
        num_tokens=num_tokens,
        num_seq_rows=num_seq_rows,
        max_blocks=max_blocks,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        max_q_len=max_q_len,
        compute_dtype=compute_dtype,
        interpret=interpret,
        kv_splits=kv_splits,
        kv_tile_tokens=kv_tile_tokens,
        target_rows=target_rows,
    )

    scale = jnp.asarray(sm_scale, jnp.float32)
    if k_scale is not None:
        scale = scale * jnp.asarray(k_scale, jnp.float32)
    scale = scale.reshape(1)
    qs = q.astype(compute_dtype)
    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    num_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), num_seq_rows)

    tables = jnp.pad(
        block_tables.astype(jnp.int32),
        ((0, 0), (0, cfg.table_width - max_blocks)),
        constant_values=NULL_BLOCK_ID,
    )
    kw = dict(
        group=group,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        compute_dtype=compute_dtype,
        interpret=interpret,
    )

    def run(t: tiles_lib.Tiles, launch: tiles_lib.LaunchTiles):
        """Output [NT, Hkv, M, D] float32 of tiles t, sized by ``launch``."""
        meta = tiles_lib.tile_meta(t, block_k=cfg.block_k, sliding_window=sliding_window)
        q_tiles = _pack_q(qs, t, num_kv_heads, launch.rows)
        if mosaic:
            return mosaic_backend.attend_tiles(
                scale, meta, tables, q_tiles, kv_cache, pages_per_tile=launch.pages_per_tile, **kw
            )
        return _combine_splits(
            *triton_backend.attend_tiles(
                scale,
                meta,
                tables,
                q_tiles,
                kv_cache,
                pages_per_tile=launch.pages_per_tile,
                num_splits=launch.kv_splits,
                num_warps=launch.num_warps,
                **kw,
            )
        )

    out = jnp.zeros((num_tokens, num_q_heads, head_size), jnp.float32)
    dec = tiles_lib.decode_tiles(seq_lens, query_start_loc, num_seqs)
    o = run(dec, cfg.decode)
    out = tiles_lib.scatter_rows(out, _unpack_out(o, dec, num_q_heads), dec)

    if cfg.prefill is not None:
        pre = tiles_lib.prefill_tiles(
            seq_lens,
            query_start_loc,
            num_seqs,
            tile_q=cfg.prefill.tile_q,
            num_tiles=cfg.prefill.num_tiles,
        )
        o = run(pre, cfg.prefill)
        out = tiles_lib.scatter_rows(out, _unpack_out(o, pre, num_q_heads), pre)
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    return out.astype(q.dtype)


def paged_attention_words(
    q: jax.Array,  # [T, Hq, D]
    words: jax.Array,  # [N, 2, Hkv, D / 128, bs / pack, 128] uint32
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    block_tables: jax.Array,  # [S, B] int32
    num_seqs: jax.Array,  # [] int32
    *,
    dtype,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
    max_q_len: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``paged_attention(backend="pallas", lowering="mosaic")`` over the TPU word layout of a
    cache of ``dtype`` (``layout.kv_cache_word_view``): the kernel DMAs whole word tiles and
    unpacks them in VMEM, so nothing the size of the cache is converted or copied. Same
    semantics and arguments as ``paged_attention``; returns [T, Hq, D] q.dtype."""
    dt = resolve_kv_dtype(dtype)
    if words.dtype != jnp.uint32 or words.ndim != 6 or words.shape[-1] != mosaic_backend.LANES:
        raise ValueError(
            f"words must be the uint32 word view [N, 2, Hkv, D / 128, bs / pack, 128], "
            f"got {words.dtype}{list(words.shape)}"
        )
    pages = mosaic_backend.WordPages(words, dt)
    check_word_layout(block_size=pages.shape[3], head_size=pages.shape[4], dtype=dt)
    validate_attention_args(
        q,
        jax.ShapeDtypeStruct(pages.shape, dt),
        seq_lens,
        query_start_loc,
        block_tables,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        max_q_len=max_q_len,
        interpret=interpret,
    )
    return paged_attention_pallas(
        q,
        pages,
        seq_lens,
        query_start_loc,
        block_tables,
        num_seqs,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        k_scale=k_scale,
        v_scale=v_scale,
        max_q_len=max_q_len or None,
        interpret=interpret,
        lowering="mosaic",
    )
