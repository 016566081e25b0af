"""KVCacheBlock, FreeKVCacheBlockQueue, BlockHashToBlockMap and BlockPool with exact orders."""

import pytest

from jaxkv.core import (
    NULL_BLOCK_ID,
    AllBlocksCleared,
    BlockHashToBlockMap,
    BlockPool,
    BlockRemoved,
    BlockStored,
    EvictionPolicy,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool):
    return ids(pool.free_block_queue.get_all_free_blocks())


def test_free_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # from the middle, O(1)
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5]
    q.append(blocks[0])
    assert ids(q.popleft_n(2)) == [1, 2]
    q.prepend_n([blocks[1], blocks[2]])
    q.append_n([blocks[3]])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 0, 3] and q.num_free_blocks == 6
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(KVCacheBlock(9))
    q.popleft_n(6)
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


def test_hash_map_allows_duplicates():
    m = BlockHashToBlockMap()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    key = (b"h", 0)
    m.insert(key, a)
    m.insert(key, b)
    assert m.get_one_block(key) is a and m.num_blocks() == 2
    assert m.pop(key, 7) is None
    assert m.pop(key, 1) is a
    assert m.get_one_block(key) is b
    assert m.pop(key, 2) is b and m.get_one_block(key) is None and len(m) == 0


class FakeRequest:
    def __init__(self, request_id, token_ids, block_hashes):
        self.request_id, self.all_token_ids, self.block_hashes = request_id, token_ids, block_hashes


def test_pool_null_block_alloc_touch_free():
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block.block_id == NULL_BLOCK_ID and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 5 and free_ids(pool) == [1, 2, 3, 4, 5]
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3] and all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="cannot get 3 free blocks, only 2"):
        pool.get_new_blocks(3)
    pool.touch([[got[0], pool.null_block]])
    assert got[0].ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.free_blocks([got[2], got[1], got[0]])
    assert free_ids(pool) == [4, 5, 3, 2] and got[0].ref_cnt == 1
    with pytest.raises(AssertionError, match="double free of block 3"):
        pool.free_blocks([got[2]])


def test_cache_evict_lazily_and_events():
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    req = FakeRequest("r", [1, 2, 3, 4, 5], [b"h0", b"h1"])
    pool.cache_full_blocks(req, blocks, 0, 2, 2, kv_cache_group_id=0)
    assert blocks[0].block_hash == (b"h0", 0)
    assert pool.get_cached_block(b"h1", [0]) == [blocks[1]]
    assert pool.get_cached_block(b"h1", [0, 1]) is None  # a miss in any group is a miss
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(b"h0", [0]) == [blocks[0]]  # still cached while free
    assert pool.take_events() == [BlockStored((b"h0", b"h1"), None, (1, 2, 3, 4), 2)]
    new = pool.get_new_blocks(4)  # [3, 4, 2, 1]: the last two evict the cached hashes
    assert ids(new) == [3, 4, 2, 1]
    assert pool.get_cached_block(b"h0", [0]) is None and blocks[0].block_hash is None
    assert pool.take_events() == [BlockRemoved((b"h1",)), BlockRemoved((b"h0",))]
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks(new)
    assert pool.reset_prefix_cache() and pool.take_events() == [AllBlocksCleared()]


def test_caching_twice_is_an_error():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    req = FakeRequest("r", [1, 2], [b"h0"])
    pool.cache_full_blocks(req, blocks, 0, 1, 2, 0)
    with pytest.raises(ValueError, match="already has hash"):
        pool.cache_full_blocks(req, blocks, 0, 1, 2, 0)
    with pytest.raises(ValueError, match="has 1 block hashes, cannot cache 2"):
        pool.cache_full_blocks(req, pool.get_new_blocks(1) * 2, 1, 2, 2, 0)


@pytest.mark.parametrize(
    "policy, expected",
    [
        # v0.11: every freed block is appended in the given order.
        (EvictionPolicy.LRU, [5, 6, 4, 3, 2, 1]),
        # Later vLLM: unhashed blocks (4, 3) go to the front, hashed ones (2, 1) to the back.
        (EvictionPolicy.LRU_UNHASHED_FIRST, [4, 3, 5, 6, 2, 1]),
    ],
)
def test_eviction_policies(policy, expected):
    pool = BlockPool(7, enable_caching=True, eviction_policy=policy)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(FakeRequest("r", list(range(4)), [b"a", b"b"]), blocks, 0, 2, 2, 0)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == expected


def test_bad_pool_size():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1.*got 0"):
        BlockPool(0)
    assert BlockPool(1).get_usage() == 0.0
