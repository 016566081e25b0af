"""Coordinators: drive one single-type manager per KV-cache group over one shared pool.

* ``KVCacheCoordinatorNoPrefixCache``: caching off, any number of groups, no hits.
* ``UnitaryKVCacheCoordinator``: caching on, one group.
* ``HybridKVCacheCoordinator``: caching on, full-attention groups plus sliding-window
  groups (one window). The hit is the full-attention hit, then the sliding-window hit
  inside it, then the full hit cut back to the same length.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.core.block import KVCacheBlock
from jaxkv.core.block_hash import BlockHash
from jaxkv.core.block_pool import BlockPool, EvictionPolicy
from jaxkv.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SlidingWindowManager,
    manager_for_spec,
)
from jaxkv.kv_cache.specs import KVCacheConfig, SlidingWindowSpec


class KVCacheCoordinator:
    """Base class: owns the pool and the managers, and loops over groups."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        track_new_block_ids: bool = False,
    ):
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            eviction_policy=eviction_policy,
            track_new_block_ids=track_new_block_ids,
        )
        self.single_type_managers = tuple(
            manager_for_spec(group.kv_cache_spec, self.block_pool, i)
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        self.num_groups = len(self.single_type_managers)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
    ) -> int:
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            total += manager.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i]
            )
        return total

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        for i, manager in enumerate(self.single_type_managers):
            manager.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers
        )

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(request_id, num_running_requests)
            for m in self.single_type_managers
        ]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """``(hit blocks per group, number of hit tokens)``."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, never a hit."""

    def __init__(
        self,
        kv_cache_config,
        max_model_len,
        enable_kv_cache_events=False,
        eviction_policy=EvictionPolicy.LRU,
        track_new_block_ids=False,
    ):
        super().__init__(
            kv_cache_config,
            max_model_len,
            False,
            enable_kv_cache_events,
            eviction_policy,
            track_new_block_ids,
        )

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        return [0] * self.num_groups

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return tuple([] for _ in range(self.num_groups)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Prefix caching on, exactly one group: delegates to its manager."""

    def __init__(
        self,
        kv_cache_config,
        max_model_len,
        enable_kv_cache_events=False,
        eviction_policy=EvictionPolicy.LRU,
        track_new_block_ids=False,
    ):
        super().__init__(
            kv_cache_config,
            max_model_len,
            True,
            enable_kv_cache_events,
            eviction_policy,
            track_new_block_ids,
        )
        if self.num_groups != 1:
            raise ValueError(
                f"UnitaryKVCacheCoordinator needs one KV-cache group, got {self.num_groups}"
            )
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        manager = self.single_type_managers[0]
        hit = type(manager).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec
        )
        return hit, len(hit[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Full-attention groups plus sliding-window groups sharing one window (vLLM v0.11).

    Requirements (ValueError otherwise): every full-attention group has the same spec,
    every sliding-window group has the same spec, all groups share one block size (block
    hashes are computed at one block size).
    """

    def __init__(
        self,
        kv_cache_config,
        max_model_len,
        enable_kv_cache_events=False,
        eviction_policy=EvictionPolicy.LRU,
        track_new_block_ids=False,
    ):
        super().__init__(
            kv_cache_config,
            max_model_len,
            True,
            enable_kv_cache_events,
            eviction_policy,
            track_new_block_ids,
        )
        groups = kv_cache_config.kv_cache_groups
        full_ids = [
            i for i, g in enumerate(groups) if not isinstance(g.kv_cache_spec, SlidingWindowSpec)
        ]
        sw_ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
        full_specs = {groups[i].kv_cache_spec for i in full_ids}
        sw_specs = {groups[i].kv_cache_spec for i in sw_ids}
        if len(full_specs) != 1 or len(sw_specs) > 1:
            raise ValueError(
                "hybrid prefix caching needs one full-attention spec and at most one sliding-window "
                f"spec; got full={sorted(map(repr, full_specs))}, sliding={sorted(map(repr, sw_specs))}"
            )
        block_sizes = sorted({g.kv_cache_spec.block_size for g in groups})
        if len(block_sizes) != 1:
            raise ValueError(
                f"hybrid prefix caching needs one block size for all groups, got {block_sizes}"
            )
        self.block_size = block_sizes[0]
        self.full_attention_group_ids = full_ids
        self.full_attention_spec = next(iter(full_specs))
        self.other_group_ids = sw_ids
        self.other_spec = next(iter(sw_specs)) if sw_specs else None

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        full_hit = FullAttentionManager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self.full_attention_group_ids,
            self.block_pool,
            self.full_attention_spec,
        )
        hit_length = len(full_hit[0]) * self.block_size
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        if self.other_spec is not None:
            other_hit = SlidingWindowManager.find_longest_cache_hit(
                block_hashes, hit_length, self.other_group_ids, self.block_pool, self.other_spec
            )
            hit_length = len(other_hit[0]) * self.block_size
            for group_id, blocks in zip(self.other_group_ids, other_hit):
                hit_blocks[group_id] = blocks
        num_blocks = hit_length // self.block_size
        for group_id, blocks in zip(self.full_attention_group_ids, full_hit):
            del blocks[num_blocks:]
            hit_blocks[group_id] = blocks
        return tuple(hit_blocks), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    enable_kv_cache_events: bool = False,
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
    track_new_block_ids: bool = False,
) -> KVCacheCoordinator:
    """Caching off (or no groups): no-prefix-cache; one group: unitary; otherwise hybrid."""
    args = (
        kv_cache_config,
        max_model_len,
        enable_kv_cache_events,
        eviction_policy,
        track_new_block_ids,
    )
    if not enable_caching or not kv_cache_config.kv_cache_groups:
        return KVCacheCoordinatorNoPrefixCache(*args)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(*args)
    return HybridKVCacheCoordinator(*args)
