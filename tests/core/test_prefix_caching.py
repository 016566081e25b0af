"""KVCacheManager with one full-attention group: literal vLLM-style scenarios (block size 16)."""

import pytest

from jaxkv.core import BlockStored, EvictionPolicy, KVCacheManager

COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks


def free_ids(manager):
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def make_manager(cfg, num_blocks=11, **kwargs):
    return KVCacheManager(cfg(num_blocks), max_model_len=8192, **kwargs)


@pytest.mark.parametrize(
    "policy, expected_free_order",
    [
        (EvictionPolicy.LRU, [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]),
        (EvictionPolicy.LRU_UNHASHED_FIRST, [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]),
    ],
)
def test_prefill(cfg, req, policy, expected_free_order):
    manager = make_manager(cfg, eviction_policy=policy)
    # Request 0: 3 full blocks + 7 tokens, a complete miss.
    req0 = req("0", COMMON + [3] * 7)
    assert len(req0.block_hashes) == 3
    computed, num_computed = manager.get_computed_blocks(req0)
    assert computed.get_block_ids() == ([],) and num_computed == 0
    blocks = manager.allocate_slots(req0, 55, num_computed, computed)
    assert blocks.get_block_ids() == ([1, 2, 3, 4],)
    # The three full blocks are cached at allocation; the partial tail is not.
    held = manager.single_type_managers[0].req_to_blocks["0"]
    assert [b.block_hash is not None for b in held] == [True, True, True, False]
    assert held[2].block_hash == (req0.block_hashes[2], 0)

    # Request 1 shares the 3 common blocks while request 0 still holds them.
    req1 = req("1", COMMON + [3] * 5)
    computed, num_computed = manager.get_computed_blocks(req1)
    assert computed.get_block_ids() == ([1, 2, 3],) and num_computed == 48
    blocks = manager.allocate_slots(req1, 53 - 48, num_computed, computed)
    assert blocks.get_block_ids() == ([5],)
    assert [b.ref_cnt for b in computed.blocks[0]] == [2, 2, 2]
    assert manager.block_pool.get_num_free_blocks() == 5

    # Free both: request 0's tail goes first, shared blocks last (last block first).
    manager.free(req0)
    manager.free(req1)
    assert free_ids(manager) == expected_free_order

    # Request 2 hits the common prefix although every block is free: touch removes
    # the hits from the middle of the queue, new blocks come from the front.
    req2 = req("2", COMMON + [9] * 20)
    computed, num_computed = manager.get_computed_blocks(req2)
    assert computed.get_block_ids() == ([1, 2, 3],) and num_computed == 48
    blocks = manager.allocate_slots(req2, 20, num_computed, computed)
    assert blocks.get_block_ids() == ([expected_free_order[0], expected_free_order[1]],)
    assert manager.block_pool.get_num_free_blocks() == 5


def test_decode_caches_blocks_as_they_fill(cfg, req):
    manager = make_manager(cfg)
    req0 = req("0", COMMON + [3] * 7)
    assert manager.allocate_slots(req0, 55).get_block_ids() == ([1, 2, 3, 4],)
    held = manager.single_type_managers[0].req_to_blocks["0"]
    # 4 more tokens fit in block 4: nothing new, block 4 still unhashed.
    req0.num_computed_tokens = 55
    req0.append_output_token_ids([8] * 4)
    assert manager.allocate_slots(req0, 4).get_block_ids() == ([],)
    assert held[-1].block_hash is None
    # 19 more: block 4 fills (and is cached), one new block for the rest.
    req0.num_computed_tokens = 59
    req0.append_output_token_ids([7] * 19)
    assert manager.allocate_slots(req0, 19).get_block_ids() == ([5],)
    assert held[-2].block_hash is not None and held[-1].block_hash is None


@pytest.mark.parametrize(
    "policy, expected_free_order",
    [
        (EvictionPolicy.LRU, [10, 6, 5, 4, 3, 2, 1, 9, 8, 7]),
        (EvictionPolicy.LRU_UNHASHED_FIRST, [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]),
    ],
)
def test_evict(cfg, req, policy, expected_free_order):
    manager = make_manager(cfg, eviction_policy=policy)
    req0 = req("0", list(range(5 * 16 + 7)))
    assert manager.allocate_slots(req0, 5 * 16 + 7).get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    req1 = req("1", list(range(87, 87 + 3 * 16)))
    assert manager.allocate_slots(req1, 3 * 16).get_block_ids() == ([7, 8, 9],)
    assert manager.block_pool.get_num_free_blocks() == 1
    manager.free(req0)
    manager.free(req1)
    assert free_ids(manager) == expected_free_order
    # Touch the first two blocks of request 0; the new block is the queue front.
    req2 = req("2", list(range(2 * 16 + 3)))
    computed, num_computed = manager.get_computed_blocks(req2)
    assert computed.get_block_ids() == ([1, 2],) and num_computed == 32
    assert manager.allocate_slots(req2, 3, num_computed, computed).get_block_ids() == (
        [expected_free_order[0]],
    )
    assert manager.block_pool.get_num_free_blocks() == 7


def test_last_token_never_hits_and_prompt_logprobs_bypass(cfg, req):
    manager = make_manager(cfg)
    req0 = req("0", COMMON)
    manager.allocate_slots(req0, 48)
    manager.free(req0)
    # Same 48 tokens: only 2 blocks may hit, the last token must be recomputed.
    _, num_computed = manager.get_computed_blocks(req("1", COMMON))
    assert num_computed == 32
    # prompt_logprobs: no hit at all (but the blocks are still written to the cache).
    computed, num_computed = manager.get_computed_blocks(req("2", COMMON + [5], prompt_logprobs=1))
    assert computed.get_block_ids() == ([],) and num_computed == 0
    plp = req("3", [7] * 33, prompt_logprobs=0)
    manager.allocate_slots(plp, 33)
    _, num_computed = manager.get_computed_blocks(req("4", [7] * 33))
    assert num_computed == 32


def test_cache_salt_isolates_tenants(cfg, req):
    manager = make_manager(cfg)
    a = req("a", COMMON + [1], cache_salt="alice")
    manager.allocate_slots(a, 49)
    assert manager.get_computed_blocks(req("b", COMMON + [1], cache_salt="bob"))[1] == 0
    assert manager.get_computed_blocks(req("c", COMMON + [1]))[1] == 0
    assert manager.get_computed_blocks(req("a2", COMMON + [1], cache_salt="alice"))[1] == 48


def test_failed_allocation_has_no_side_effect(cfg, req):
    manager = make_manager(cfg, num_blocks=6)  # 5 usable blocks
    req0 = req("0", COMMON + [3])
    manager.allocate_slots(req0, 49)  # blocks 1..4
    manager.free(req0)
    before = free_ids(manager)
    assert before == [5, 4, 3, 2, 1]
    # Hit 3 free blocks + 4 new blocks = 7 > 5: refused, hits untouched.
    req1 = req("1", COMMON + [4] * 60)
    computed, num_computed = manager.get_computed_blocks(req1)
    assert num_computed == 48
    assert manager.allocate_slots(req1, 60, num_computed, computed) is None
    assert free_ids(manager) == before
    assert all(b.ref_cnt == 0 for b in computed.blocks[0])
    assert "1" not in manager.single_type_managers[0].req_to_blocks
    with pytest.raises(ValueError, match="num_new_tokens must be positive, got 0"):
        manager.allocate_slots(req1, 0)


def test_spec_tokens_get_slots_but_are_not_cached(cfg, req):
    manager = make_manager(cfg)
    r = req("0", list(range(30)))
    r.spec_token_ids = [1, 2, 3, 4]  # 34 tokens with drafts
    blocks = manager.allocate_slots(r, 34)
    assert blocks.get_block_ids() == ([1, 2, 3],)
    held = manager.single_type_managers[0].req_to_blocks["0"]
    assert [b.block_hash is not None for b in held] == [
        True,
        False,
        False,
    ]  # 30 // 16 = 1 full block
    # Lookahead slots are extra slots beyond the new tokens.
    r2 = req("1", list(range(100, 116)))
    assert len(manager.allocate_slots(r2, 16, num_lookahead_tokens=1).blocks[0]) == 2


def test_stats_events_and_reset(cfg, req):
    manager = make_manager(cfg, enable_kv_cache_events=True)
    r0 = req("0", COMMON + [3])
    manager.get_computed_blocks(r0)
    manager.allocate_slots(r0, 49)
    (event,) = manager.take_events()
    assert isinstance(event, BlockStored) and event.block_hashes == tuple(r0.block_hashes)
    assert event.parent_block_hash is None and event.token_ids == tuple(COMMON)
    r1 = req("1", COMMON + [4])
    manager.get_computed_blocks(r1)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 98, 48)
    assert manager.make_prefix_cache_stats().requests == 0
    assert not manager.reset_prefix_cache()
    manager.free(r0)
    assert manager.reset_prefix_cache() and manager.make_prefix_cache_stats().reset
    assert manager.get_computed_blocks(r1)[1] == 0


def test_caching_disabled(cfg, req):
    manager = make_manager(cfg, enable_caching=False)
    r = req("0", COMMON + [1])
    manager.allocate_slots(r, 49)
    manager.free(r)
    assert manager.get_computed_blocks(req("1", COMMON + [1]))[1] == 0
    assert manager.block_pool.cached_block_hash_to_block.num_blocks() == 0
