"""KV-cache events (what entered and left the prefix cache), as vLLM's ``kv_events``.

The block pool queues them as it works; the scheduler drains the queue once per step into
one ``KVEventBatch``. Hashes are the raw block hashes, without the group id (as vLLM v0.11).
"""

from __future__ import annotations

import dataclasses

from jaxkv.core.block_hash import BlockHash

#: Where the blocks live (vLLM says "GPU"; here it is whatever device jax runs on).
MEDIUM_DEVICE = "device"


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Full blocks inserted into the prefix cache by one ``cache_full_blocks`` call.

    Attributes:
        block_hashes: One hash per new cached block, in sequence order.
        parent_block_hash: Hash of the block before the first one, or None at block 0.
        token_ids: The tokens of all those blocks, concatenated.
        block_size: Tokens per block.
        lora_id: Always None here (no LoRA yet).
        medium: ``MEDIUM_DEVICE``.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM_DEVICE


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """A cached block was evicted (its id was reused)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_DEVICE


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` emptied the cache."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True)
class KVEventBatch:
    """The events of one scheduler step, in pool order."""

    ts: float
    events: tuple[KVCacheEvent, ...]
