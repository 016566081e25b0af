"""Sliding-window manager and the hybrid (full + sliding window) coordinator."""

import pytest

from jaxkv.core import BlockPool, KVCacheManager, SlidingWindowManager


def block_ids(blocks):
    return [b.block_id for b in blocks]


@pytest.mark.parametrize(
    "is_cached, expect_length",
    [
        ([False] * 10, 0),
        ([True], 1),
        ([True, False], 1),
        ([True, True], 2),
        ([True, True, False], 2),
        ([True, True, True], 3),
        ([True, True, True, False], 3),
        ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
        ([True, True, False, True, False, False, True, True, False, False, False], 8),
        ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
    ],
)
def test_cache_hit_scans_right_to_left(specs, is_cached, expect_length):
    # Window 4, block size 2: a hit needs cdiv(4 - 1, 2) = 2 contiguous cached blocks.
    spec = specs[1](block_size=2, sliding_window=4)
    pool = BlockPool(40)
    hashes = [str(i).encode() for i in range(len(is_cached))]
    for i, cached in enumerate(is_cached):
        if cached:
            pool.cached_block_hash_to_block.insert((hashes[i], 0), pool.blocks[i + 10])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(hashes, len(hashes) * 2, [0], pool, spec)
    assert len(hit) == expect_length
    # Everything before the last two blocks is the null block; those two are real.
    assert all(b is pool.null_block for b in hit[: max(expect_length - 2, 0)])
    for i in range(max(expect_length - 2, 0), expect_length):
        assert hit[i].block_id == i + 10


def test_remove_skipped_blocks_nulls_and_frees(specs):
    spec = specs[1](block_size=2, sliding_window=4)
    pool = BlockPool(12)
    manager = SlidingWindowManager(spec, pool, 0)
    held = pool.get_new_blocks(10)  # ids 1..10 for positions 0..19
    manager.req_to_blocks["r"] = list(held)

    def table():
        return block_ids(manager.req_to_blocks["r"])

    manager.remove_skipped_blocks("r", 4)  # next query at 4 reads 1..4: block 0 still needed
    assert table() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    manager.remove_skipped_blocks("r", 5)  # reads 2..5: block 0 (positions 0, 1) dropped
    assert table() == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    manager.remove_skipped_blocks("r", 11)  # reads 8..11: blocks 1..3 dropped
    assert table() == [0, 0, 0, 0, 5, 6, 7, 8, 9, 10]
    # Deeper blocks are freed first.
    assert block_ids(pool.free_block_queue.get_all_free_blocks()) == [11, 1, 4, 3, 2]


def test_window_group_holds_a_bounded_number_of_blocks(cfg, req, specs):
    # Window 32, block 16: each decode step needs at most cdiv(31 + 1, 16) + 1 = 3 blocks.
    manager = KVCacheManager(cfg(8, specs[1](sliding_window=32)), max_model_len=4096)
    r = req("r", list(range(40)))
    manager.allocate_slots(r, 40)
    r.num_computed_tokens = 40
    for step in range(400):
        r.append_output_token_ids(step % 7)
        assert manager.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        table = manager.single_type_managers[0].req_to_blocks["r"]
        assert len(table) == -(-r.num_tokens // 16)  # one entry per block position
        assert sum(not b.is_null for b in table) <= 3
        assert manager.block_pool.get_num_free_blocks() >= 7 - 3
    manager.free(r)
    assert manager.block_pool.get_num_free_blocks() == 7


def test_hybrid_hit_full_then_window_then_cut_back(cfg, req, specs):
    # Groups: 0 = full attention, 1 = sliding window 17 (a hit needs 1 cached block).
    full, sw = specs
    manager = KVCacheManager(cfg(11, full(), sw(sliding_window=17)), max_model_len=4096)
    prompt = list(range(64))
    a = req("a", prompt)
    assert manager.allocate_slots(a, 64).get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    # A decodes one token: its window (48..64) no longer needs window blocks 0..2, which
    # are nulled and freed (still cached); the new position-4 blocks are 9 and 10.
    a.num_computed_tokens = 64
    a.append_output_token_ids(99)
    assert manager.allocate_slots(a, 1).get_block_ids() == ([9], [10])
    assert manager.get_block_ids("a") == ([1, 2, 3, 4, 9], [0, 0, 0, 8, 10])
    free = block_ids(manager.block_pool.free_block_queue.get_all_free_blocks())
    assert free == [7, 6, 5]
    # A filler request evicts block 7 (full group) and block 6 (window group).
    c = req("c", [500] * 16)
    assert manager.allocate_slots(c, 16).get_block_ids() == ([7], [6])

    # 64-token prefix: the full hit is 4 blocks, the window needs only block 3 -> 64 tokens.
    hit, num = manager.get_computed_blocks(req("b1", prompt + [1]))
    assert num == 64 and hit.get_block_ids() == ([1, 2, 3, 4], [0, 0, 0, 8])
    # 48-token prefix: full hit 3 blocks, but window block 2 (id 7) was evicted and
    # block 1 too; only the run at block 0 (id 5, still cached while free) remains, so
    # the window hit is 16 tokens and the full hit is cut back to 1 block.
    b2 = req("b2", prompt[:48] + [1])
    hit, num = manager.get_computed_blocks(b2)
    assert num == 16 and hit.get_block_ids() == ([1], [5])
    # Adopting it needs 3 + 3 new blocks plus free block 5: only block 5 is free, so the
    # allocation is refused and block 5 stays in the free queue, unreferenced.
    assert manager.allocate_slots(b2, 33, num, hit) is None
    assert manager.block_pool.blocks[5].ref_cnt == 0
    assert block_ids(manager.block_pool.free_block_queue.get_all_free_blocks()) == [5]


def test_hybrid_config_validation(cfg, specs):
    full, sw = specs
    with pytest.raises(ValueError, match="at most one sliding-window spec"):
        KVCacheManager(
            cfg(10, full(), sw(sliding_window=16), sw(sliding_window=32)), max_model_len=64
        )
    with pytest.raises(ValueError, match="different block sizes"):
        KVCacheManager(cfg(10, full(16), sw(32)), max_model_len=64)
    # Without prefix caching any mix of groups is fine.
    KVCacheManager(cfg(10, full(16), sw(32)), max_model_len=64, enable_caching=False)
