"""Query tiles: how a ragged batch is cut into fixed-size pieces of one sequence each.

Shared by the XLA backend and the Pallas kernels (plain jnp index math, no kernels here).

Every real sequence's LAST query row forms a "decode tile" (one row per sequence row of the
batch, S tiles, static). The other rows of a sequence (a prefill chunk minus its last token)
are cut into "prefill tiles" of ``tile_q`` consecutive rows. So a pure-decode batch has no
prefill tiles, and a mixed batch's prefill work is proportional to its prefill tokens, never
to T x all-KV.

Example: query_start_loc = [0, 5, 6, 7], tile_q = 2 -> decode tiles take rows 4, 5, 6 and
prefill tiles are seq 0 rows [0, 1] and [2, 3] (two tiles).

The static sizes every attention lowering runs with (query tile, KV tile, KV splits, warps) are
chosen here, by :func:`choose_tiles`, and the per-tile metadata the Pallas kernels read has its
one column layout here (:data:`META_COLUMNS`, :func:`tile_meta`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

#: Columns of the per-tile metadata array (int32 [NT, META_COLS]) the Pallas kernels (Triton and
#: Mosaic) read, in order: the tile's sequence row, the position of its first query row, its
#: valid rows (0 = empty tile), the keys it needs [key_lo, key_hi), the KV tiles [kv_t0, kv_t1)
#: of ``block_k`` keys holding them, and a zero pad column (8 int32 columns).
META_COLUMNS = ("seq", "pos0", "num_q", "key_lo", "key_hi", "kv_t0", "kv_t1", "pad")
SEQ, POS0, NUM_Q, KV_LO, KV_HI, KV_T0, KV_T1, PAD = range(len(META_COLUMNS))
META_COLS = len(META_COLUMNS)

#: Rows per prefill tile of the XLA backend (upper bound; smaller when max_q_len is small).
MAX_TILE_Q = 256
#: XLA prefill: logits per KV head and inner iteration of a tile (tile_q x keys), and the key
#: range (``prefill_keys_for``).
PREFILL_LOGITS = 8192
PREFILL_KEYS = (128, 512)
#: XLA decode: bytes of K/V one iteration gathers over all tiles. Fewer, bigger iterations
#: amortise the loop's per-iteration cost (dominant for few long sequences); smaller chunks stay
#: in cache (better for many sequences). Measured on 2 CPU cores (f32, Hkv 2, D 64, decode),
#: 4 MiB vs 1 MiB per iteration: 1.26x faster at 1 row x 16k keys, 1.37x at 16 x 4k, 1.24x at
#: 64 x 300; 8 MiB was no better.
CHUNK_BYTES = 4 << 20
#: XLA decode: keys of one work item (whole blocks).
ITEM_KEYS = 64

#: Pallas: (token, query head) rows a prefill tile aims for (tile_q x G, at head_size <= 128).
TARGET_ROWS = 64
#: Pallas: keys per KV tile by default. Triton: 64. Mosaic: a full MXU/lane width of logits.
TRITON_KV_TILE_TOKENS = 64
MOSAIC_KV_TILE_TOKENS = 128
#: Triton: programs wanted to fill a GPU (H100/H200: 132 SMs, ~2 programs each), and the most
#: KV splits of a decode tile.
TARGET_PROGRAMS = 264
MAX_KV_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class Tiles:
    """NT query tiles of ``tile_q`` rows; each belongs to one sequence (or is empty)."""

    seq: jax.Array  # [NT] int32 sequence row (clipped into [0, S))
    row0: jax.Array  # [NT] int32 first packed query row of the tile
    num_q: jax.Array  # [NT] int32 valid rows in the tile (0 = empty tile)
    pos0: jax.Array  # [NT] int32 position (in its sequence) of the first row
    seq_len: jax.Array  # [NT] int32 KV length of the tile's sequence
    tile_q: int  # static rows per tile

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


def _q_lens(query_start_loc, num_seqs, num_seq_rows):
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    real = jnp.arange(num_seq_rows) < num_seqs
    return jnp.where(real, q_len, 0)


def decode_tiles(
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,
) -> Tiles:
    """One tile per sequence row holding its last query row (empty for padding rows)."""
    num_seq_rows = seq_lens.shape[0]
    q_len = _q_lens(query_start_loc, num_seqs, num_seq_rows)
    has = (q_len > 0).astype(jnp.int32)
    return Tiles(
        seq=jnp.arange(num_seq_rows, dtype=jnp.int32),
        row0=(query_start_loc[1:] - 1).astype(jnp.int32),
        num_q=has,
        pos0=(seq_lens - 1).astype(jnp.int32),
        seq_len=seq_lens.astype(jnp.int32),
        tile_q=1,
    )


def prefill_tile_counts(query_start_loc, num_seqs, tile_q: int):
    """Per-sequence count of prefill tiles ([S] int32) and their total ([] int32)."""
    q_len = _q_lens(query_start_loc, num_seqs, query_start_loc.shape[0] - 1)
    counts = (jnp.maximum(q_len - 1, 0) + tile_q - 1) // tile_q
    return counts.astype(jnp.int32), jnp.sum(counts).astype(jnp.int32)


def prefill_tile_q(max_q_len: int, max_tile_q: int) -> int:
    """Rows per prefill tile: a power of two >= max_q_len - 1 (the rows besides the last),
    at most ``max_tile_q``."""
    return min(max_tile_q, 1 << max(0, (max_q_len - 2).bit_length()))


def max_prefill_tiles(num_tokens: int, num_seq_rows: int, tile_q: int, max_q_len: int) -> int:
    """Static upper bound on the number of prefill tiles.

    Each sequence with q_len >= 2 contributes ceil((q_len - 1) / tile_q) <= (q_len - 1) / tile_q + 1
    tiles, there are at most min(S, T // 2) of them, and never more tiles than non-last rows.
    """
    if max_q_len <= 1 or num_tokens < 2:
        return 0
    n_prefill = min(num_seq_rows, num_tokens // 2)
    per_seq = -(-(max_q_len - 1) // tile_q)
    return max(1, min(num_tokens // tile_q + n_prefill, n_prefill * per_seq, num_tokens - 1))


def prefill_tiles(
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,
    *,
    tile_q: int,
    num_tiles: int,
) -> Tiles:
    """The first ``num_tiles`` prefill tiles (tiles past the real count are empty)."""
    num_seq_rows = seq_lens.shape[0]
    q_len = _q_lens(query_start_loc, num_seqs, num_seq_rows)
    counts, total = prefill_tile_counts(query_start_loc, num_seqs, tile_q)
    ends = jnp.cumsum(counts)  # [S]
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(ends, i, side="right"), 0, num_seq_rows - 1).astype(jnp.int32)
    j = i - (ends[seq] - counts[seq])  # tile index in its seq
    first = j * tile_q
    num_q = jnp.where(i < total, jnp.clip(q_len[seq] - 1 - first, 0, tile_q), 0)
    return Tiles(
        seq=seq,
        row0=(query_start_loc[seq] + first).astype(jnp.int32),
        num_q=num_q.astype(jnp.int32),
        pos0=(seq_lens[seq] - q_len[seq] + first).astype(jnp.int32),
        seq_len=seq_lens[seq].astype(jnp.int32),
        tile_q=tile_q,
    )


def key_range(tiles: Tiles, *, sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """Keys a tile's rows need, [lo, hi) per tile ([NT] each): rows at positions
    pos0 .. pos0 + num_q - 1 attend [max(0, pos0 - W + 1), pos0 + num_q)."""
    hi = tiles.pos0 + tiles.num_q  # exclusive key end
    lo = (
        jnp.zeros_like(hi)
        if sliding_window is None
        else jnp.maximum(tiles.pos0 - sliding_window + 1, 0)
    )
    return lo, hi


def kv_block_range(
    tiles: Tiles, *, block_size: int, max_blocks: int, sliding_window: int | None
) -> tuple[jax.Array, jax.Array, int]:
    """Blocks a tile needs: [first, end) per tile ([NT] int32 each) and a static count bound.

    The blocks holding ``key_range``'s keys. Without a window the bound is the table width B;
    with one it is min(B, ceil((W + tile_q - 2) / bs) + 1).
    """
    lo, hi = key_range(tiles, sliding_window=sliding_window)
    bound = kv_block_bound(
        tiles.tile_q, block_size=block_size, max_blocks=max_blocks, sliding_window=sliding_window
    )
    first = lo // block_size
    end = jnp.where(tiles.num_q > 0, (hi + block_size - 1) // block_size, first)
    return first.astype(jnp.int32), jnp.minimum(end, max_blocks).astype(jnp.int32), bound


def kv_block_bound(
    tile_q: int, *, block_size: int, max_blocks: int, sliding_window: int | None
) -> int:
    """Static bound on the blocks one tile of ``tile_q`` rows needs (see ``kv_block_range``)."""
    if sliding_window is None:
        return max_blocks
    return min(max_blocks, -(-(sliding_window + tile_q - 2) // block_size) + 1)


def scatter_rows(
    dst,  # [T, Hq, D]
    tile_out,  # [NT, Qt, Hq, D]
    t: Tiles,
):
    """Writes valid tile rows into dst [T, Hq, D]; empty rows are dropped (out of range)."""
    num_tokens = dst.shape[0]
    rows = t.row0[:, None] + jnp.arange(t.tile_q, dtype=jnp.int32)[None, :]
    ok = jnp.arange(t.tile_q)[None, :] < t.num_q[:, None]
    rows = jnp.where(ok, rows, num_tokens).reshape(-1)
    return dst.at[rows].set(tile_out.reshape(-1, *dst.shape[1:]), mode="drop")


def tile_meta(t: Tiles, *, block_k: int, sliding_window: int | None) -> jax.Array:
    """The Pallas kernels' per-tile metadata of ``t``: [NT, META_COLS] int32, ``META_COLUMNS``."""
    key_lo, key_hi = key_range(t, sliding_window=sliding_window)
    t0 = key_lo // block_k
    t1 = jnp.where(t.num_q > 0, (key_hi + block_k - 1) // block_k, t0)
    cols = dict(
        seq=t.seq,
        pos0=t.pos0,
        num_q=t.num_q,
        key_lo=key_lo,
        key_hi=key_hi,
        kv_t0=t0,
        kv_t1=t1,
        pad=jnp.zeros_like(t0),
    )
    return jnp.stack([cols[name].astype(jnp.int32) for name in META_COLUMNS], axis=1)


# ---- tile sizes ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchTiles:
    """Static sizes of one launch over a set of query tiles (a call's decode or prefill tiles).

    Example (Triton, Hq 8, Hkv 2, D 128, bs 16, S 8, T 64, max_q_len 64, on a GPU): decode
    tiles ``LaunchTiles(tile_q=1, num_tiles=8, rows=16, pages_per_tile=4, kv_splits=16,
    num_warps=4)``; prefill tiles ``LaunchTiles(tile_q=16, num_tiles=12, rows=64,
    pages_per_tile=4, num_warps=8)``.
    """

    tile_q: int  # query tokens per tile (1: decode tiles, a sequence's last row)
    num_tiles: int  # static tile count: S decode tiles, or the prefill bound (max_prefill_tiles)
    rows: int  # M: (token, query head) rows of a tile, tile_q x G padded as the lowering needs
    pages_per_tile: int  # KV pages per inner-loop step: block_k = pages_per_tile x bs keys
    kv_splits: int = 1  # programs sharing one tile's keys (flash-decoding; Triton decode only)
    num_warps: int | None = None  # Triton warps per program; None for the other lowerings
    items_per_step: int = 1  # XLA decode: work items of pages_per_tile pages per loop iteration


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Every static tile size of one attention call (:func:`choose_tiles`)."""

    lowering: str  # "triton" | "mosaic" (the Pallas kernels) | "xla"
    block_size: int  # bs: tokens per KV page
    table_width: int  # block-table columns the kernels index: B padded to whole KV tiles
    decode: LaunchTiles  # the S one-row decode tiles
    prefill: LaunchTiles | None  # prefill tiles; None: the call has none (max_q_len 1 or T 1)

    @property
    def block_k(self) -> int:
        """Keys per KV tile of the decode tiles (the Pallas lowerings' one KV tile)."""
        return self.decode.pages_per_tile * self.block_size


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def triton_num_warps(rows: int, head_size: int) -> int:
    """Warps of a Triton program over [rows, head_size] tiles: 4, or 8 for M x D >= 64 x 128
    (their f32 accumulator, scores and q tile need more than 255 registers a thread at 4 warps:
    ptxas spilled 12 bytes for M 64, D 128, 64 keys on jax 0.11.2, sm_90a)."""
    return 8 if rows * head_size >= 64 * 128 else 4


def mosaic_tile_rows(n: int, compute_dtype) -> int:
    """Rows of a Mosaic query tile holding ``n`` (token, head) rows: whole sublane tiles (8 rows
    of 32-bit, 16 of 16-bit values)."""
    sub = 8 * (4 // jnp.dtype(compute_dtype).itemsize)
    return -(-max(n, 1) // sub) * sub


def prefill_keys_for(tile_q: int) -> int:
    """XLA: keys per inner iteration of a prefill tile, PREFILL_LOGITS / tile_q within
    PREFILL_KEYS.

    Measured (2 cores, f32, Hkv 2, G 4; one call): 256-row tiles over 128 keys vs 256 keys:
    13 fresh prompts U[32, 256] 11.8 vs 14.4 ms (less of the causal triangle's far side),
    2 x 512 rows at 4k context 61.8 vs 59.6; 32-row tiles want 256 keys (15.2 vs 20.4 ms).
    """
    lo, hi = PREFILL_KEYS
    return max(lo, min(hi, PREFILL_LOGITS // tile_q))


def decode_items(
    num_kv_heads: int,
    head_size: int,
    itemsize: int,
    block_size: int,
    *,
    bound_blocks: int,
    num_rows: int,
) -> tuple[int, int]:
    """XLA: (blocks per decode work item C, items per iteration W): an item covers ~ITEM_KEYS
    keys (whole blocks, at most the rows' block bound); W items gather ~CHUNK_BYTES.

    W is at most half the items the rows can have in all, so the loop keeps >= 2 static
    iterations: with one, XLA inlines the body and materialises the converted pages outside
    any reduction (8 rows of 16..512 keys: 4.6 vs 2.9 ms for 8 layers).
    """
    c = max(1, min(ITEM_KEYS // block_size, bound_blocks))
    per_item = c * block_size * 2 * num_kv_heads * head_size * itemsize
    return c, max(1, min(CHUNK_BYTES // per_item, num_rows * -(-bound_blocks // c) // 2))


def choose_tiles(
    lowering: str,
    *,
    num_tokens: int,
    num_seq_rows: int,
    max_blocks: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_q_len: int | None = None,
    sliding_window: int | None = None,
    compute_dtype=jnp.float32,
    cache_dtype=jnp.float32,
    interpret: bool = False,
    kv_splits: int | None = None,
    kv_tile_tokens: int | None = None,
    target_rows: int = TARGET_ROWS,
) -> TileConfig:
    """The static tile sizes of one attention call of these shapes, for ``lowering``.

    Shapes: T ``num_tokens``, S ``num_seq_rows``, B ``max_blocks``, Hq, Hkv, D, bs; ``max_q_len``
    bounds any q_len (None: T). ``compute_dtype`` sizes Mosaic's sublane-padded rows,
    ``cache_dtype`` the XLA decode items. Pallas knobs (ValueError when invalid):
    ``kv_splits`` KV splits of decode tiles (None: from the program count, 1 in interpret mode;
    Triton only), ``kv_tile_tokens`` keys per KV tile (None: 64 Triton, 128 Mosaic),
    ``target_rows`` (token, head) rows per prefill tile.

    Pallas (Triton and Mosaic): one KV tile of ``pages_per_tile = max(1, kv_tile_tokens / bs,
    16 / bs)`` pages for all tiles; a prefill tile has ``tile_q`` = the largest power of two
    with tile_q x G <= max(16, target_rows x 128 / max(D, 128)) (past D 128 the rows shrink so
    Triton's f32 accumulator stays in registers: compiled for an H200 with D = 256, 64 rows
    spilled 376 bytes at 255 registers and took 160 KiB of shared memory; 32 rows do not
    spill), at most the power of two >= max_q_len - 1. Triton pads rows to a power of two
    >= 16 and splits decode keys to reach TARGET_PROGRAMS programs; Mosaic pads rows to whole
    sublane tiles. XLA: prefill tiles of up to MAX_TILE_Q rows over ``prefill_keys_for`` keys
    an iteration; decode work items from ``decode_items``.
    """
    group = num_q_heads // num_kv_heads
    max_q = num_tokens if max_q_len is None else min(max_q_len, num_tokens)
    if lowering == "xla":
        return _choose_xla(
            num_tokens=num_tokens,
            num_seq_rows=num_seq_rows,
            max_blocks=max_blocks,
            group=group,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=block_size,
            max_q=max_q,
            sliding_window=sliding_window,
            itemsize=jnp.dtype(cache_dtype).itemsize,
        )
    if lowering not in ("triton", "mosaic"):
        raise ValueError(f"lowering must be 'triton', 'mosaic' or 'xla', got {lowering!r}")
    mosaic = lowering == "mosaic"
    if kv_tile_tokens is None:
        kv_tile_tokens = MOSAIC_KV_TILE_TOKENS if mosaic else TRITON_KV_TILE_TOKENS
    if mosaic:
        if kv_splits not in (None, 1):
            raise ValueError(
                f"kv_splits is a Triton (GPU) option; lowering='mosaic' runs "
                f"unsplit, got kv_splits={kv_splits}"
            )
        kv_splits = 1
    else:
        for name, n in (
            ("head_size", head_size),
            ("block_size", block_size),
            ("kv_tile_tokens", kv_tile_tokens),
        ):
            if n & (n - 1):
                raise ValueError(
                    f"backend='pallas' needs a power-of-two {name} (Triton tiles), got {n}"
                )
    if kv_splits is not None and (kv_splits < 1 or kv_splits & (kv_splits - 1)):
        raise ValueError(f"kv_splits must be a power of two >= 1, got {kv_splits}")
    if kv_splits is None:
        programs = num_seq_rows * num_kv_heads
        kv_splits = (
            1
            if interpret
            else min(MAX_KV_SPLITS, _pow2_at_most(max(1, TARGET_PROGRAMS // programs)))
        )
    pages_per_tile = max(1, kv_tile_tokens // block_size, 16 // block_size)

    def launch(tile_q: int, num_tiles: int, splits: int) -> LaunchTiles:
        n_rows = tile_q * group
        if mosaic:
            return LaunchTiles(
                tile_q, num_tiles, mosaic_tile_rows(n_rows, compute_dtype), pages_per_tile
            )
        rows = _pow2_at_least(max(16, n_rows))
        return LaunchTiles(
            tile_q,
            num_tiles,
            rows,
            pages_per_tile,
            kv_splits=splits,
            num_warps=triton_num_warps(rows, head_size),
        )

    prefill = None
    if max_q > 1 and num_tokens > 1:
        rows = max(16, target_rows * 128 // max(head_size, 128))
        tile_q = min(_pow2_at_most(max(1, rows // group)), _pow2_at_least(max_q - 1))
        prefill = launch(tile_q, max_prefill_tiles(num_tokens, num_seq_rows, tile_q, max_q), 1)
    return TileConfig(
        lowering=lowering,
        block_size=block_size,
        table_width=-(-max_blocks // pages_per_tile) * pages_per_tile,
        decode=launch(1, num_seq_rows, kv_splits),
        prefill=prefill,
    )


def _choose_xla(
    *,
    num_tokens,
    num_seq_rows,
    max_blocks,
    group,
    num_kv_heads,
    head_size,
    block_size,
    max_q,
    sliding_window,
    itemsize,
) -> TileConfig:
    """``choose_tiles`` for the XLA backend (no kernels: loops over gathered pages)."""
    bounds = dict(block_size=block_size, max_blocks=max_blocks, sliding_window=sliding_window)
    c, w = decode_items(
        num_kv_heads,
        head_size,
        itemsize,
        block_size,
        bound_blocks=kv_block_bound(1, **bounds),
        num_rows=num_seq_rows,
    )
    decode = LaunchTiles(1, num_seq_rows, group, c, items_per_step=w)
    prefill = None
    tile_q = prefill_tile_q(max_q, MAX_TILE_Q)
    bound = max_prefill_tiles(num_tokens, num_seq_rows, tile_q, max_q)
    if bound > 0:
        chunk = max(
            1, min(kv_block_bound(tile_q, **bounds), prefill_keys_for(tile_q) // block_size)
        )
        prefill = LaunchTiles(tile_q, bound, tile_q * group, chunk)
    return TileConfig(
        lowering="xla",
        block_size=block_size,
        table_width=max_blocks,
        decode=decode,
        prefill=prefill,
    )
