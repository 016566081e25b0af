"""KVCacheManager: the scheduler's allocator (prefix hits, slot allocation, free)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv.core.block import KVCacheBlock
from jaxkv.core.block_pool import EvictionPolicy
from jaxkv.core.kv_cache_coordinator import get_kv_cache_coordinator
from jaxkv.core.kv_events import KVCacheEvent
from jaxkv.core.metrics import PrefixCacheStats
from jaxkv.core.request import Request
from jaxkv.kv_cache.specs import KVCacheConfig, SlidingWindowSpec, cdiv


@dataclasses.dataclass
class KVCacheBlocks:
    """Blocks per KV-cache group, the value passed between manager and scheduler.

    ``blocks[g]`` is the list for group ``g`` (null blocks included for sliding windows).
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; with ``allow_none``, None when no group has a block."""
        if allow_none and all(len(b) == 0 for b in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the (single group's) blocks that are not in the prefix cache."""
        if len(self.blocks) != 1:
            raise ValueError(f"get_unhashed_block_ids needs one group, got {len(self.blocks)}")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.blocks))


class KVCacheManager:
    """Prefix-cache lookups and block allocation for the scheduler (vLLM V1 semantics).

    Args:
        kv_cache_config: Groups and ``num_blocks`` (block 0 is the null block).
        max_model_len: Slots are never allocated beyond this many tokens.
        enable_caching: Automatic prefix caching.
        log_stats: Collect ``PrefixCacheStats``.
        enable_kv_cache_events: Queue KV events (see ``take_events``).
        eviction_policy: ``EvictionPolicy`` of the pool.
        track_new_block_ids: Record new block ids for ``take_new_block_ids``.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = True,
        enable_kv_cache_events: bool = False,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        track_new_block_ids: bool = False,
    ):
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.enable_caching = enable_caching and self.num_kv_cache_groups > 0
        if self.enable_caching:
            self.block_size = kv_cache_config.block_size  # raises on mixed block sizes
        else:
            sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
            self.block_size = sizes[0] if sizes else 0
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            self.enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            eviction_policy=eviction_policy,
            track_new_block_ids=track_new_block_ids,
        )
        self.block_pool = self.coordinator.block_pool
        self.single_type_managers = self.coordinator.single_type_managers
        #: Shared empty value (its lists are tuples, so nobody can append to it).
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Returns the stats since the last call and starts a new interval."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # ---- lookup ----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``request``: ``(blocks per group, hit tokens)``.

        At most ``num_tokens - 1`` tokens hit (the last token is always recomputed, its
        logits are needed). Requests with ``prompt_logprobs``, and pooling requests that pool
        more than the last token, get no hit (their prompt must be recomputed) but still
        write their blocks into the cache. Nothing is reserved: the blocks are only touched
        by ``allocate_slots``.
        """
        pooling = request.pooling_params
        if (
            not self.enable_caching
            or request.sampling_params.prompt_logprobs is not None
            or (pooling is not None and pooling.needs_every_token)
        ):
            return self.empty_kv_cache_blocks, 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_new_computed_tokens
        return KVCacheBlocks(computed_blocks), num_new_computed_tokens

    # ---- allocation ------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Reserves slots for ``num_new_tokens`` tokens after the computed ones.

        Layout of the request's tokens::

            | computed | new computed (hit) | new | lookahead |
            |<--------------- required ------------------>|
            |<----- cached at allocation ----->|  (capped at request.num_tokens)

        Returns the newly allocated blocks (hits excluded), or None when the pool cannot
        hold them. On None the only side effect is that sliding-window blocks already out
        of the window were freed. Full blocks among the computed + new tokens (capped at
        ``num_tokens``, so speculative tokens are never cached) are inserted into the prefix
        cache now, before the forward pass, unless ``delay_cache_blocks``.
        ``request.num_computed_tokens`` is not changed here (the scheduler does that).
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        if new_computed_blocks is not None:
            new_computed_block_list = new_computed_blocks.blocks
        else:
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        coordinator = self.coordinator
        request_id = request.request_id

        # Free the blocks that fell out of a sliding window first, so they can be reused.
        coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, new_computed_block_list
        )
        if num_blocks_to_allocate > self.block_pool.free_block_queue.num_free_blocks:
            return None

        if self.enable_caching:
            if new_computed_blocks is not None:
                self.block_pool.touch(new_computed_block_list)
        elif any(new_computed_block_list):
            raise ValueError("computed blocks were passed but prefix caching is disabled")

        coordinator.save_new_computed_blocks(request_id, new_computed_block_list)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)

        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            coordinator.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's full blocks among its first ``num_computed_tokens`` tokens."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Frees the request's blocks in every group, last block first; hashes survive."""
        self.coordinator.free(request.request_id)

    # ---- queries ---------------------------------------------------------------------
    def max_blocks_per_request(
        self, num_tokens: int, max_num_batched_tokens: int, num_lookahead_tokens: int = 0
    ) -> int:
        """Most blocks (all groups) one request of ``num_tokens`` tokens can hold at once.

        Full attention keeps ``cdiv(num_tokens, bs)``; a sliding window keeps at most the
        window plus one step's tokens, plus one block for a window not aligned to blocks.
        """
        total = 0
        for group in self.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            blocks = cdiv(num_tokens + num_lookahead_tokens, spec.block_size)
            if isinstance(spec, SlidingWindowSpec):
                window_tokens = (
                    spec.sliding_window - 1 + max_num_batched_tokens + num_lookahead_tokens
                )
                blocks = min(blocks, cdiv(window_tokens, spec.block_size) + 1)
            total += blocks
        return total

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """All blocks of a request (hits + allocated), per group."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(
            [b.block_id for b in blocks] for blocks in self.coordinator.get_blocks(request_id)
        )

    def get_num_common_prefix_blocks(
        self, request: Request, num_running_requests: int
    ) -> list[int]:
        """Per group, leading blocks held by all ``num_running_requests`` running requests."""
        return self.coordinator.get_num_common_prefix_blocks(
            request.request_id, num_running_requests
        )

    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache if no block is in use; returns success."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def take_new_block_ids(self) -> list[int]:
        return self.block_pool.take_new_block_ids()

    def take_newly_cached_block_ids(self) -> list[int]:
        """Blocks put into the prefix cache since the last call (their KV is written by the
        step being scheduled)."""
        return self.block_pool.take_newly_cached_block_ids()

    def evict_blocks(self, block_ids) -> int:
        """Drops these blocks from the prefix cache (see ``BlockPool.evict_blocks``)."""
        return self.block_pool.evict_blocks(block_ids)

    def create_empty_block_list(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))
