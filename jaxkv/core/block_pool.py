"""The block pool: every physical block, the free queue, the prefix cache and KV events."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from jaxkv.core.block import NULL_BLOCK_ID, BlockHashToBlockMap, FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.core.block_hash import BlockHash
from jaxkv.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class EvictionPolicy(str, enum.Enum):
    """Where ``free_blocks`` puts blocks whose ref count reaches 0.

    ``LRU`` (default, vLLM v0.11): every freed block goes to the back of the free queue in
    the order given, so the least recently freed block is reused first.

    ``LRU_UNHASHED_FIRST`` (vLLM after v0.11): blocks without a hash hold nothing reusable,
    so they go to the front (kept in the given order) and are reused first; hashed blocks
    go to the back. This keeps more useful cache for the same pool.
    """

    LRU = "lru"
    LRU_UNHASHED_FIRST = "lru_unhashed_first"


class BlockPool:
    """Owns blocks ``0 .. num_blocks - 1`` for all KV-cache groups.

    Block 0 is the null block, popped from the free queue at construction, so
    ``num_blocks - 1`` blocks are usable. Cached (hashed) blocks keep their hash after they
    are freed; the hash is dropped lazily when the block is handed out again (eviction)
    or on ``reset_prefix_cache``.

    Args:
        num_blocks: Total blocks including the null block (>= 1).
        enable_caching: Whether full blocks are inserted into the prefix cache.
        enable_kv_cache_events: Whether to queue ``BlockStored``/``BlockRemoved``/... events.
        eviction_policy: See ``EvictionPolicy``.
        track_new_block_ids: Record the ids handed out by ``get_new_blocks`` for
            ``take_new_block_ids`` (the scheduler reports them as blocks to zero).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        track_new_block_ids: bool = False,
    ):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(
                f"num_blocks must be an int >= 1 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self._unhashed_first = self.eviction_policy is EvictionPolicy.LRU_UNHASHED_FIRST

        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        assert self.null_block.block_id == NULL_BLOCK_ID
        self.kv_event_queue: list[KVCacheEvent] = []
        #: Ids handed out by ``get_new_blocks`` since the last ``take_new_block_ids``.
        self._new_block_ids: list[int] | None = [] if track_new_block_ids else None
        #: Ids of blocks ``cache_full_blocks`` hashed since the last ``take_newly_cached_block_ids``
        #: (cached at allocation, before the step that writes their KV has run).
        self._newly_cached: list[int] = []

    # ---- prefix cache ----------------------------------------------------------------
    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        cached = []
        get_one_block = self.cached_block_hash_to_block.get_one_block
        for group_id in kv_cache_group_ids:
            block = get_one_block((block_hash, group_id))
            if block is None:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(
        self,
        request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Inserts ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache.

        Their hashes are ``request.block_hashes`` at the same indices. Null blocks (dropped
        sliding-window blocks) are skipped.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes = request.block_hashes
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id!r} has {len(block_hashes)} block hashes, "
                f"cannot cache {num_full_blocks} full blocks"
            )
        insert = self.cached_block_hash_to_block.insert
        new_hashes = [] if self.enable_kv_cache_events else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block_hash = block_hashes[i]
            key = (block_hash, kv_cache_group_id)
            block.block_hash = key  # raises if already set
            insert(key, block)
            self._newly_cached.append(block.block_id)
            if new_hashes is not None:
                new_hashes.append(block_hash)
        if new_hashes:
            parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=tuple(new_hashes),
                    parent_block_hash=parent,
                    token_ids=tuple(
                        request.all_token_ids[
                            num_cached_blocks * block_size : num_full_blocks * block_size
                        ]
                    ),
                    block_size=block_size,
                )
            )

    # ---- allocation ------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` from the front of the free queue (evicting their hashes)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} free blocks, only {self.free_block_queue.num_free_blocks} are free"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if block._block_hash is not None:
                self._evict_cached_block(block)
            block.ref_cnt = 1
        if self._new_block_ids is not None:
            self._new_block_ids.extend([b.block_id for b in ret])
        return ret

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        key = block._block_hash
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            raise AssertionError(
                f"block {block.block_id} has hash {key!r} but is not in the cache map"
            )
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(block_hashes=(key[0],)))

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Removes these blocks from the prefix cache (those that have a hash); returns how
        many were removed. For blocks cached for tokens whose KV was never written (a step
        that failed): they must never be served as hits. Ref counts are not touched."""
        removed = 0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block._block_hash is not None:
                self._evict_cached_block(block)
                removed += 1
        return removed

    def touch(self, blocks: Iterable[Iterable[KVCacheBlock]]) -> None:
        """Takes a reference on prefix-hit blocks (per group), removing free ones from the queue."""
        remove = self.free_block_queue.remove
        for group_blocks in blocks:
            for block in group_blocks:
                if block.is_null:
                    continue  # the null block's ref count is not maintained
                if block.ref_cnt == 0:
                    remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 re-enter the free queue.

        ``ordered_blocks`` is in eviction order (first = evicted first among them).
        """
        freed = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        if not freed:
            return
        if self._unhashed_first:
            # Without caching no block has a hash, so all of them go to the front.
            unhashed = [b for b in freed if b._block_hash is None]
            if unhashed:
                self.free_block_queue.prepend_n(unhashed)
                freed = [b for b in freed if b._block_hash is not None]
        if freed:
            self.free_block_queue.append_n(freed)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only allowed when no block is in use. Returns success."""
        num_used = self.num_gpu_blocks - self.free_block_queue.num_free_blocks
        if num_used != 1:  # only the null block
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ---- stats -----------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use: ``1 - free / (num_blocks - 1)``."""
        total = self.num_gpu_blocks - 1
        if total <= 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVCacheEvent]:
        """Returns and clears the queued KV events."""
        if not self.kv_event_queue:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def take_newly_cached_block_ids(self) -> list[int]:
        """Ids of the blocks hashed since the last call (in caching order)."""
        ids, self._newly_cached = self._newly_cached, []
        return ids

    def take_new_block_ids(self) -> list[int]:
        """Ids handed out since the last call, each once, in allocation order."""
        if self._new_block_ids is None:
            raise ValueError("BlockPool was built with track_new_block_ids=False")
        ids, self._new_block_ids = self._new_block_ids, []
        if len(ids) > 1:
            ids = list(dict.fromkeys(ids))
        return ids
