"""Host-side engine core (plain Python, no jax): requests, block pool, managers, scheduler.

Data flow: ``Scheduler.add_request(Request)`` -> ``Scheduler.schedule() -> SchedulerOutput``
(worker runs it) -> ``Scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput)
-> list[EngineCoreOutput]``.
"""

from jaxkv.core.block import NULL_BLOCK_ID, BlockHashToBlockMap, FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.core.block_hash import (
    HASH_ALGOS,
    BlockHash,
    BlockHashWithGroupId,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
)
from jaxkv.core.block_pool import BlockPool, EvictionPolicy
from jaxkv.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from jaxkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from jaxkv.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from jaxkv.core.metrics import PrefixCacheStats, PrefixCachingMetrics, SchedulerStats
from jaxkv.core.outputs import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy
from jaxkv.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxkv.core.scheduler import Scheduler
from jaxkv.core.scheduler_config import SchedulerConfig
from jaxkv.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from jaxkv.core.stop_check import check_stop

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CachedRequestData",
    "EngineCoreOutput",
    "EvictionPolicy",
    "FCFSRequestQueue",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "HASH_ALGOS",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheEvent",
    "KVCacheManager",
    "KVEventBatch",
    "ModelRunnerOutput",
    "NULL_BLOCK_ID",
    "NewRequestData",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "PriorityRequestQueue",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "TokenLogprobs",
    "UnitaryKVCacheCoordinator",
    "check_stop",
    "get_hash_fn",
    "get_kv_cache_coordinator",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
]
