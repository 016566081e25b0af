"""``tiles.choose_tiles``: the literal tile sizes each lowering runs with for a few shapes, and the
one per-tile metadata layout both Pallas kernels read."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.pallas_kernels import tiles
from jaxkv.pallas_kernels.tiles import LaunchTiles, TileConfig, choose_tiles

#: T 64, S 8, B 16, Hq 8, Hkv 2 (G 4), D 128, bs 16.
SMALL = dict(
    num_tokens=64,
    num_seq_rows=8,
    max_blocks=16,
    num_q_heads=8,
    num_kv_heads=2,
    head_size=128,
    block_size=16,
)


def test_triton_mixed_batch():
    cfg = choose_tiles("triton", **SMALL, max_q_len=64)
    assert cfg == TileConfig(
        lowering="triton",
        block_size=16,
        table_width=16,
        # 16 (seq, head) programs -> 264 // 16 = 16 splits; rows padded to 16; 64 keys a KV tile.
        decode=LaunchTiles(
            tile_q=1, num_tiles=8, rows=16, pages_per_tile=4, kv_splits=16, num_warps=4
        ),
        # 64 rows / G 4 = 16 tokens a tile; 64 x 128 tiles take 8 warps.
        prefill=LaunchTiles(tile_q=16, num_tiles=12, rows=64, pages_per_tile=4, num_warps=8),
    )
    assert cfg.block_k == 64


def test_triton_decode_only_and_interpret():
    assert choose_tiles("triton", **SMALL, max_q_len=1).prefill is None
    cfg = choose_tiles("triton", **SMALL, max_q_len=3, interpret=True)
    assert cfg.decode.kv_splits == 1  # no splits in interpret mode
    # tile_q is at most the power of two >= max_q_len - 1.
    assert cfg.prefill == LaunchTiles(tile_q=2, num_tiles=8, rows=16, pages_per_tile=4, num_warps=4)


def test_triton_large_head_and_small_pages():
    # D 256 halves the prefill rows (32: 4 tokens x G 8); bs 32 -> 2 pages a KV tile.
    cfg = choose_tiles(
        "triton",
        num_tokens=512,
        num_seq_rows=4,
        max_blocks=64,
        num_q_heads=16,
        num_kv_heads=2,
        head_size=256,
        block_size=32,
        max_q_len=200,
    )
    assert cfg.decode == LaunchTiles(
        tile_q=1, num_tiles=4, rows=16, pages_per_tile=2, kv_splits=16, num_warps=4
    )
    assert cfg.prefill == LaunchTiles(
        tile_q=4, num_tiles=132, rows=32, pages_per_tile=2, num_warps=8
    )
    # 256 rows x 8 heads fill the GPU: no splits; 5 table columns pad to whole KV tiles of 4.
    cfg = choose_tiles(
        "triton",
        num_tokens=256,
        num_seq_rows=256,
        max_blocks=5,
        num_q_heads=32,
        num_kv_heads=8,
        head_size=64,
        block_size=8,
        max_q_len=16,
        kv_tile_tokens=32,
    )
    assert (cfg.decode.kv_splits, cfg.decode.pages_per_tile, cfg.table_width) == (1, 4, 8)
    assert cfg.prefill == LaunchTiles(
        tile_q=16, num_tiles=128, rows=64, pages_per_tile=4, num_warps=4
    )


def test_mosaic():
    cfg = choose_tiles("mosaic", **SMALL, max_q_len=64, compute_dtype=jnp.bfloat16)
    # 128 keys a KV tile, rows in whole 16-row bf16 sublane tiles, never split.
    assert cfg == TileConfig(
        lowering="mosaic",
        block_size=16,
        table_width=16,
        decode=LaunchTiles(tile_q=1, num_tiles=8, rows=16, pages_per_tile=8),
        prefill=LaunchTiles(tile_q=16, num_tiles=12, rows=64, pages_per_tile=8),
    )
    cfg = choose_tiles(
        "mosaic",
        num_tokens=32,
        num_seq_rows=2,
        max_blocks=4,
        num_q_heads=8,
        num_kv_heads=1,
        head_size=128,
        block_size=64,
        max_q_len=17,
        compute_dtype=jnp.float32,
    )
    assert cfg.decode == LaunchTiles(tile_q=1, num_tiles=2, rows=8, pages_per_tile=2)
    assert cfg.prefill == LaunchTiles(tile_q=8, num_tiles=4, rows=64, pages_per_tile=2)


def test_xla():
    cfg = choose_tiles("xla", **SMALL, max_q_len=64, cache_dtype=jnp.float32)
    assert cfg.decode == LaunchTiles(
        tile_q=1, num_tiles=8, rows=4, pages_per_tile=4, items_per_step=16
    )
    assert cfg.prefill == LaunchTiles(tile_q=64, num_tiles=8, rows=256, pages_per_tile=8)
    cfg = choose_tiles(
        "xla",
        num_tokens=2048,
        num_seq_rows=64,
        max_blocks=128,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        sliding_window=100,
        cache_dtype=jnp.bfloat16,
    )
    assert cfg.decode == LaunchTiles(
        tile_q=1, num_tiles=64, rows=4, pages_per_tile=4, items_per_step=64
    )
    assert cfg.prefill == LaunchTiles(tile_q=256, num_tiles=72, rows=1024, pages_per_tile=8)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(lowering="triton", kv_splits=3), "kv_splits must be a power of two"),
        (dict(lowering="triton", kv_tile_tokens=24), "power-of-two kv_tile_tokens"),
        (dict(lowering="mosaic", kv_splits=2), "kv_splits is a Triton"),
        (dict(lowering="cuda"), "lowering must be"),
    ],
)
def test_invalid_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        choose_tiles(**SMALL, **kw)


def test_tile_meta_columns():
    """One row per tile, columns in ``META_COLUMNS`` order (both kernels index them by name)."""
    qsl = jnp.asarray([0, 5, 6, 7], jnp.int32)
    seq_lens = jnp.asarray([9, 3, 1], jnp.int32)
    t = tiles.prefill_tiles(seq_lens, qsl, jnp.int32(3), tile_q=2, num_tiles=2)
    meta = np.asarray(tiles.tile_meta(t, block_k=4, sliding_window=None))
    assert meta.shape == (2, tiles.META_COLS) and tiles.META_COLS == len(tiles.META_COLUMNS)
    # seq 0 has 9 keys and 5 new rows: tiles at positions 4-5 and 6-7.
    np.testing.assert_array_equal(meta[:, tiles.SEQ], [0, 0])
    np.testing.assert_array_equal(meta[:, tiles.POS0], [4, 6])
    np.testing.assert_array_equal(meta[:, tiles.NUM_Q], [2, 2])
    np.testing.assert_array_equal(meta[:, tiles.KV_LO], [0, 0])
    np.testing.assert_array_equal(meta[:, tiles.KV_HI], [6, 8])
    np.testing.assert_array_equal(meta[:, tiles.KV_T0], [0, 0])
    np.testing.assert_array_equal(meta[:, tiles.KV_T1], [2, 2])
    np.testing.assert_array_equal(meta[:, tiles.PAD], [0, 0])
