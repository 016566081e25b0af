"""Query tiles: how a ragged batch is cut into fixed-size pieces of one sequence each.

Shared by the XLA backend and the Pallas kernels (plain jnp index math, no kernels here).

Every real sequence's LAST query row forms a "decode tile" (one row per sequence row of the
batch, S tiles, static). The other rows of a sequence (a prefill chunk minus its last token)
are cut into "prefill tiles" of ``tile_q`` consecutive rows. So a pure-decode batch has no
prefill tiles, and a mixed batch's prefill work is proportional to its prefill tokens, never
to T x all-KV.

Example: query_start_loc = [0, 5, 6, 7], tile_q = 2 -> decode tiles take rows 4, 5, 6 and
prefill tiles are seq 0 rows [0, 1] and [2, 3] (two tiles).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
    bound = (
        max_blocks
        if sliding_window is None
        else min(max_blocks, -(-(sliding_window + tiles.tile_q - 2) // block_size) + 1)
    )
    first = lo // block_size
    end = jnp.where(tiles.num_q > 0, (hi + block_size - 1) // block_size, first)
    return first.astype(jnp.int32), jnp.minimum(end, max_blocks).astype(jnp.int32), bound


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
