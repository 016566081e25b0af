"""Per-attention-type block managers: which blocks one KV-cache group gives each request."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from jaxkv.core.block import KVCacheBlock
from jaxkv.core.block_hash import BlockHash
from jaxkv.core.block_pool import BlockPool
from jaxkv.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv


class SingleTypeKVCacheManager:
    """Block bookkeeping of one KV-cache group (one attention type, one block table).

    State: ``req_to_blocks[request_id]`` (the request's block list for this group, null
    blocks included) and ``num_cached_block[request_id]`` (how many of those are in the
    prefix cache; present for live requests only).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int):
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks needed to hold ``num_tokens`` tokens.

        Prefix-hit blocks that sit in the free queue (ref 0) count too: touching them takes
        them out of the queue.
        """
        num_required = cdiv(num_tokens, self.block_size)
        num_new = (
            num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        )
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return max(num_new, 0) + num_evictable

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Adopts the prefix hit of a request that has no blocks in this group yet."""
        if request_id not in self.num_cached_block:
            req_blocks = self.req_to_blocks[request_id]
            if req_blocks:
                raise AssertionError(f"request {request_id!r} has blocks but no cache record")
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"running request {request_id!r} cannot adopt prefix-hit blocks")

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Appends fresh blocks so that the request can hold ``num_tokens`` tokens."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Inserts the request's full blocks among its first ``num_tokens`` tokens into the cache."""
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Frees all of the request's blocks, last block first (so tails are evicted first)."""
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(reversed(req_blocks))

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Longest prefix hit of at most ``max_length`` tokens, one block list per group."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees blocks no longer needed (replacing them by the null block)."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Causal attention over the whole sequence: a request keeps all its blocks."""

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec
    ):
        """Scans hashes left to right and stops at the first miss in any group."""
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_num_blocks = max_length // kv_cache_spec.block_size
        if len(kv_cache_group_ids) == 1:
            get_one_block = block_pool.cached_block_hash_to_block.get_one_block
            group_id = kv_cache_group_ids[0]
            out = computed[0]
            for block_hash in block_hashes[:max_num_blocks]:
                block = get_one_block((block_hash, group_id))
                if block is None:
                    break
                out.append(block)
            return computed
        for block_hash in block_hashes[:max_num_blocks]:
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for out, block in zip(computed, cached):
                out.append(block)
        return computed

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks shared by every running request (a cascade-attention hint)."""
        count = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Attention over the last ``sliding_window`` tokens.

    Blocks wholly before the window of the next token are replaced by the null block and
    freed, so a request holds at most ``cdiv(sliding_window - 1 + new_tokens, block_size) + 1``
    real blocks however long it grows.
    """

    def __init__(
        self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int
    ):
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec
    ):
        """Scans right to left for ``cdiv(window - 1, block_size)`` contiguous cached blocks.

        A query at position ``p`` reads positions ``p - window + 1 .. p``, so to resume at
        token ``L`` only the ``window - 1`` tokens before it must be cached. Blocks before
        the run become null blocks. Worked example, window 4, block_size 2 (2 contiguous
        blocks needed), cached hashes at blocks [0, 2, 3] of 5: scanning from block 4 finds
        3 and 2, so the hit is [null, null, b2, b3] (8 tokens). If no run is long enough the
        hit is the leading run from block 0 (whose window starts at the sequence start).
        """
        block_size = kv_cache_spec.block_size
        num_contiguous = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        null_block = block_pool.null_block
        computed = tuple([null_block] * max_num_blocks for _ in kv_cache_group_ids)
        num_contiguous_hits = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                num_contiguous_hits = 0
                continue
            for out, block in zip(computed, cached):
                out[i] = block
            num_contiguous_hits += 1
            if num_contiguous_hits >= num_contiguous:
                for out in computed:
                    del out[i + num_contiguous_hits :]
                match_found = True
                break
        if not match_found:
            # Only the run starting at block 0 (possibly empty) is usable.
            for out in computed:
                del out[num_contiguous_hits:]
        return computed

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nulls and frees the blocks wholly before ``num_computed_tokens - window + 1``.

        Worked example, window 4, block_size 2, 9 computed tokens: the next query (position
        9) reads 6..9, so blocks 0..2 (positions 0..5) are dropped. Deeper blocks are freed
        first (they are evicted first).
        """
        last_useful_token = num_computed_tokens - self.sliding_window + 1
        last_useful_block = last_useful_token // self.block_size
        if last_useful_block <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null_block = self._null_block
        removed = []
        for i in range(min(last_useful_block, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break  # everything before is already null
            removed.append(block)
            blocks[i] = null_block
        if removed:
            self.block_pool.free_blocks(removed)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        return 0


def manager_for_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class for a spec (``SlidingWindowSpec`` subclasses ``FullAttentionSpec``)."""
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_spec, block_pool, kv_cache_group_id)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, kv_cache_group_id)
    raise TypeError(f"no KV-cache manager for spec {kv_cache_spec!r}")
