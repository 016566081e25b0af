"""Block metadata, the free queue (eviction order) and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from jaxkv.core.block_hash import BlockHashWithGroupId

#: Block 0 is reserved as the null block: a placeholder in block tables (sliding-window
#: blocks that were dropped, prefix hits outside the window). Never handed out or cached.
NULL_BLOCK_ID = 0


class KVCacheBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: 0 .. num_blocks - 1 (0 is the null block).
        ref_cnt: Number of requests holding the block; 0 means free (possibly still cached).
        block_hash: ``(hash, group_id)`` while the block is in the prefix cache, else None.
            Set once per allocation (setting it twice is a bug).
        prev_free_block / next_free_block: Intrusive links of ``FreeKVCacheBlockQueue``.
        is_null: True only for the null block.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHashWithGroupId | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise ValueError(
                f"block {self.block_id} already has hash {self._block_hash!r}; reset it first"
            )
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self._block_hash is not None}, is_null={self.is_null})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, front = evicted (reused) first.

    The links live on the blocks themselves, so removing a block from the middle (a
    prefix-cache hit on a free block) is O(1), which a ``deque`` cannot do. Fake head and
    tail sentinels remove the edge cases. It starts in block-id order.

    Example: blocks [0, 1, 2, 3]: ``popleft() -> 0``, ``remove(block 2)``, ``append(block 0)``
    leaves the order [1, 3, 0].
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the front block; ValueError if the queue is empty."""
        first = self.fake_head.next_free_block
        if first is self.fake_tail:
            raise ValueError("No free blocks available")
        self.fake_head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.fake_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the ``n`` front blocks in queue order."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        result = []
        curr = self.fake_head.next_free_block
        for _ in range(n):
            result.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        self.fake_head.next_free_block = curr
        curr.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return result

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks ``block`` from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the back (evicted last)."""
        last = self.fake_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Appends ``blocks`` in the given order."""
        last = self.fake_tail.prev_free_block
        count = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
            count += 1
        last.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Puts ``blocks`` at the front, keeping their order (``blocks[0]`` becomes the front)."""
        first = self.fake_head.next_free_block
        prev = self.fake_head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front first (for tests and debugging; O(n))."""
        result = []
        curr = self.fake_head.next_free_block
        while curr is not self.fake_tail:
            result.append(curr)
            curr = curr.next_free_block
        return result


class BlockHashToBlockMap:
    """``BlockHashWithGroupId -> block``, allowing several blocks per key.

    Duplicates happen when two requests compute the same block at the same time; vLLM does
    not deduplicate (block tables stay append-only), and neither do we. A key maps to one
    block, or to a dict ``{block_id: block}`` once it has several; lookups return the first
    inserted.
    """

    def __init__(self):
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Removes and returns the block ``block_id`` under ``key`` (None if absent)."""
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        elif not entry:
            del self._cache[key]
        return block

    def __len__(self) -> int:
        """Number of keys (not blocks)."""
        return len(self._cache)

    def num_blocks(self) -> int:
        return sum(1 if isinstance(e, KVCacheBlock) else len(e) for e in self._cache.values())
