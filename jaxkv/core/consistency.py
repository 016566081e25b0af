"""Invariants of the scheduler and its block pool, checked as a whole.

``scheduler_problems(scheduler)`` lists every broken invariant (empty when all hold). The
engine runs it after recovering from a failed step (an exception raised at an arbitrary
point can leave a structure half-updated); tests run it after every operation. It is
O(blocks + requests), so it is not run on the normal path.

Invariants:
  * the free queue is a well-formed list of exactly the non-null blocks with ref count 0,
    and ``num_free_blocks`` is its length;
  * every block's ref count equals the number of its holders over all groups' managers;
  * only running requests hold blocks, and, with a KV connector, requests waiting for an
    asynchronous load and finished ones whose blocks are kept until sent;
  * every prefix-cache entry points to a block that carries that hash;
  * every live request is in exactly one of ``running`` / ``waiting``, with a matching
    status, and nothing else is in those queues; finished requests kept for a send are in
    neither.
"""

from __future__ import annotations

from collections import Counter

from jaxkv.core.request import RequestStatus


def block_pool_problems(pool, holders: Counter | None = None) -> list[str]:
    """Broken invariants of a ``BlockPool`` (with ``holders``: block id -> holder count)."""
    problems = []
    queue = pool.free_block_queue
    seen: set[int] = set()
    curr = queue.fake_head.next_free_block
    while curr is not None and curr is not queue.fake_tail:
        if curr.block_id in seen:
            problems.append(f"block {curr.block_id} is twice in the free queue")
            break
        seen.add(curr.block_id)
        if len(seen) > pool.num_gpu_blocks:
            problems.append("the free queue is longer than the pool")
            break
        curr = curr.next_free_block
    if curr is None:
        problems.append("the free queue does not end at its tail")
    if len(seen) != queue.num_free_blocks:
        problems.append(
            f"the free queue holds {len(seen)} blocks but counts {queue.num_free_blocks}"
        )
    for block in pool.blocks:
        if block.is_null:
            if block.block_id in seen:
                problems.append("the null block is in the free queue")
            continue
        free = block.block_id in seen
        if free != (block.ref_cnt == 0):
            problems.append(
                f"block {block.block_id} has ref count {block.ref_cnt} and is "
                f"{'' if free else 'not '}in the free queue"
            )
        if holders is not None and block.ref_cnt != holders.get(block.block_id, 0):
            problems.append(
                f"block {block.block_id} has ref count {block.ref_cnt} but "
                f"{holders.get(block.block_id, 0)} holders"
            )
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        for block in (entry,) if not isinstance(entry, dict) else entry.values():
            if block.block_hash != key:
                problems.append(
                    f"cache entry {key!r} points to block {block.block_id} with hash "
                    f"{block.block_hash!r}"
                )
    return problems


def scheduler_problems(scheduler) -> list[str]:
    """Every broken invariant of a ``Scheduler`` (see the module docstring)."""
    problems = []
    kv = scheduler.kv_cache_manager
    holders: Counter = Counter()
    holding: set[str] = set()
    for manager in kv.single_type_managers:
        for req_id, blocks in manager.req_to_blocks.items():
            if blocks:
                holding.add(req_id)
            holders.update(b.block_id for b in blocks if not b.is_null)
    problems += block_pool_problems(kv.block_pool, holders)
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    if len(set(running_ids)) != len(running_ids):
        problems.append(f"a request is twice in running: {running_ids}")
    if len(set(waiting_ids)) != len(waiting_ids):
        problems.append(f"a request is twice in waiting: {waiting_ids}")
    both = set(running_ids) & set(waiting_ids)
    if both:
        problems.append(f"requests both running and waiting: {sorted(both)}")
    queued = set(running_ids) | set(waiting_ids)
    sending = set(getattr(scheduler, "_sending", ()))
    if queued | sending != set(scheduler.requests) or queued & sending:
        problems.append(
            f"live requests in no queue: {sorted(set(scheduler.requests) - queued)}; "
            f"queued requests not live: {sorted(queued - set(scheduler.requests))}"
        )
    for r in scheduler.running:
        if r.status != RequestStatus.RUNNING:
            problems.append(f"running request {r.request_id!r} has status {r.status.name}")
    loading = set(getattr(scheduler, "_remote_loads", ()))
    for r in scheduler.waiting:
        if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and not (
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.request_id in loading
        ):
            problems.append(f"waiting request {r.request_id!r} has status {r.status.name}")
    for req_id in sending:
        request = scheduler.requests.get(req_id)
        if request is None or not request.is_finished():
            problems.append(f"request {req_id!r} kept for a send is not finished")
    stray = holding - set(running_ids) - loading - sending
    if stray:
        problems.append(f"requests that are not running hold blocks: {sorted(stray)}")
    return problems
