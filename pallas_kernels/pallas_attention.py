"""``backend="pallas"``: tiles the ragged batch (``tiles.py``) and runs the GPU or TPU kernel.

Lowering-neutral glue: builds per-tile metadata, packs query rows into [NT, Hkv, M, D] tiles,
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
from jaxkv.pallas_kernels.layout import compute_dtype as compute_dtype_for
from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID
from jaxkv.pallas_kernels.validation import resolve_lowering

#: Query rows (tile_q x G) a prefill tile aims for, and keys per KV tile.
TARGET_ROWS = 64
KV_TILE_TOKENS = 64
#: Programs wanted to fill a GPU (H100/H200: 132 SMs, ~2 programs each).
TARGET_PROGRAMS = 264
MAX_KV_SPLITS = 16


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _tile_meta(t: tiles_lib.Tiles, *, block_k: int, sliding_window) -> jax.Array:
    """[NT, 8] int32 metadata (column order in triton_backend)."""
    key_lo, key_hi = tiles_lib.key_range(t, sliding_window=sliding_window)
    t0 = key_lo // block_k
    t1 = jnp.where(t.num_q > 0, (key_hi + block_k - 1) // block_k, t0)
    cols = [t.seq, t.pos0, t.num_q, key_lo, key_hi, t0, t1, jnp.zeros_like(t0)]
    return jnp.stack([c.astype(jnp.int32) for c in cols], axis=1)


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
    """
    num_tokens, num_q_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    num_seq_rows, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    mosaic = resolve_lowering(lowering, interpret) == "mosaic"
    if kv_tile_tokens is None:
        kv_tile_tokens = mosaic_backend.KV_TILE_TOKENS if mosaic else KV_TILE_TOKENS
    if mosaic:
        mosaic_backend.check_shapes(head_size=head_size, block_size=block_size)
        if kv_splits not in (None, 1):
            raise ValueError(
                f"kv_splits is a Triton (GPU) option; lowering='mosaic' runs "
                f"unsplit, got kv_splits={kv_splits}"
            )
        kv_splits = 1
    for name, n in (
        ("head_size", head_size),
        ("block_size", block_size),
        ("kv_tile_tokens", kv_tile_tokens),
    ):
        if not mosaic and n & (n - 1):
            raise ValueError(
                f"backend='pallas' needs a power-of-two {name} (Triton tiles), got {n}"
            )
    if kv_splits is not None and (kv_splits < 1 or kv_splits & (kv_splits - 1)):
        raise ValueError(f"kv_splits must be a power of two >= 1, got {kv_splits}")
    max_q = num_tokens if max_q_len is None else min(max_q_len, num_tokens)

    compute_dtype = compute_dtype_for(q.dtype, kv_cache.dtype)
    scale = jnp.asarray(sm_scale, jnp.float32)
    if k_scale is not None:
        scale = scale * jnp.asarray(k_scale, jnp.float32)
    scale = scale.reshape(1)
    qs = q.astype(compute_dtype)
    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    num_seqs = jnp.minimum(jnp.asarray(num_seqs, jnp.int32), num_seq_rows)

    pages_per_tile = max(1, kv_tile_tokens // block_size, 16 // block_size)
    block_k = pages_per_tile * block_size
    width = -(-max_blocks // pages_per_tile) * pages_per_tile
    tables = jnp.pad(
        block_tables.astype(jnp.int32),
        ((0, 0), (0, width - max_blocks)),
        constant_values=NULL_BLOCK_ID,
    )
    kw = dict(
        group=group,
        pages_per_tile=pages_per_tile,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        compute_dtype=compute_dtype,
        interpret=interpret,
    )

    def run(t, n_rows, splits):
        """Output [NT, Hkv, M, D] float32 of tiles t with n_rows (token, head) rows each."""
        meta = _tile_meta(t, block_k=block_k, sliding_window=sliding_window)
        if mosaic:
            return mosaic_backend.attend_tiles(
                scale,
                meta,
                tables,
                _pack_q(qs, t, num_kv_heads, mosaic_backend.tile_rows(n_rows, compute_dtype)),
                kv_cache,
                **kw,
            )
        return _combine_splits(
            *triton_backend.attend_tiles(
                scale,
                meta,
                tables,
                _pack_q(qs, t, num_kv_heads, _pow2_at_least(max(16, n_rows))),
                kv_cache,
                num_splits=splits,
                **kw,
            )
        )

    out = jnp.zeros((num_tokens, num_q_heads, head_size), jnp.float32)
    dec = tiles_lib.decode_tiles(seq_lens, query_start_loc, num_seqs)
    if kv_splits is None:
        programs = num_seq_rows * num_kv_heads
        kv_splits = (
            1
            if interpret
            else min(MAX_KV_SPLITS, _pow2_at_most(max(1, TARGET_PROGRAMS // programs)))
        )
    o = run(dec, group, kv_splits)
    out = tiles_lib.scatter_rows(out, _unpack_out(o, dec, num_q_heads), dec)

    if max_q > 1 and num_tokens > 1:
        # A tile's f32 accumulator is rows x head_size: past head_size 128 the rows shrink so
        # it stays in registers (compiled for an H200 with D = 256, 64 rows spilled 376 bytes
        # at 255 registers and took 160 KiB of shared memory; 32 rows do not spill).
        rows = max(16, target_rows * 128 // max(head_size, 128))
        tile_q = min(_pow2_at_most(max(1, rows // group)), _pow2_at_least(max_q - 1))
        bound = tiles_lib.max_prefill_tiles(num_tokens, num_seq_rows, tile_q, max_q)
        pre = tiles_lib.prefill_tiles(
            seq_lens, query_start_loc, num_seqs, tile_q=tile_q, num_tiles=bound
        )
        o = run(pre, tile_q * group, 1)
        out = tiles_lib.scatter_rows(out, _unpack_out(o, pre, num_q_heads), pre)
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    return out.astype(q.dtype)
