"""Synchronous KV loads that failed: their KV is never served; they recompute from the first
invalid block.

A connector may give a request external tokens synchronously (``get_num_new_matched_tokens``
returns ``(n, False)``): the scheduler counts them computed at once, caches the request's
full blocks at allocation and the step that loads them also computes the rest of the prompt
and samples. When the workers report some of those blocks invalid
(``KVConnectorOutput.invalid_block_ids``, with that step's results),
``recompute_failed_sync_loads`` makes the state right before the step's tokens are applied:

1. the request's blocks from the first invalid one on (in every group) are evicted from the
   prefix cache: their KV was loaded wrong or computed over wrong KV;
2. every running request that holds one of those blocks (the request itself, and any request
   that got a prefix hit on them in the same schedule or, with async scheduling, the next
   one) is recomputed as after a preemption: its blocks are freed, its progress reset, the
   token its step sampled from the bad KV is dropped (it is no longer RUNNING when the
   results are applied), and it goes back to the front of the waiting queue. Re-admitted,
   its valid prefix is a prefix-cache hit, so it recomputes from the first invalid block
   (vLLM's ``kv_load_failure_policy="recompute"``); a request still waiting for an
   asynchronous load on top of such blocks is marked failed (it recomputes when the load
   ends);
3. the failed request never asks the connector again; the runner is told through the next
   schedule's ``preempted_req_ids``; with async scheduling a recomputed request is not
   re-admitted while a step in flight still contains it (that step's results for it are
   dropped).
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxkv.core.request import RequestStatus

_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS


def loaded_tail(
    block_ids: tuple[list[int], ...], num_local_tokens: int, block_size: int
) -> list[list[int]]:
    """A copy of a request's blocks (per group) from its first externally loaded block on:
    the blocks a failed synchronous load can spoil (loaded, or computed over loaded KV)."""
    first = num_local_tokens // block_size
    return [list(ids[first:]) for ids in block_ids]


def _first_index(groups: Iterable[list[int]], bad: set[int]) -> int | None:
    return min((i for ids in groups for i, b in enumerate(ids) if b in bad), default=None)


def recompute_failed_sync_loads(
    scheduler, scheduler_output, invalid_block_ids: set[int]
) -> list[str]:
    """Applies rules 1-3 of the module docstring for the synchronous loads of
    ``scheduler_output``'s step (their records are dropped either way); returns the ids of
    the requests sent back to recompute."""
    loads = scheduler._sync_loads
    tails = {r: loads.pop(r) for r in scheduler_output.num_scheduled_tokens if r in loads}
    if not tails or not invalid_block_ids:
        return []
    failed: list[str] = []
    spoiled: set[int] = set()
    for req_id, groups in tails.items():
        first = _first_index(groups, invalid_block_ids)
        if first is not None:
            failed.append(req_id)
            spoiled.update(b for ids in groups for b in ids[first:] if b)
    if not failed:
        return []
    kv = scheduler.kv_cache_manager
    scheduler.num_failed_kv_loads += len(failed)
    scheduler._no_connector.update(failed)
    # Holders of spoiled blocks (the failed requests, prefix hits on them): their blocks
    # from the first spoiled one on were computed over bad KV too.
    victims = []
    for request in scheduler.running:
        groups = kv.get_block_ids(request.request_id)
        first = _first_index(groups, spoiled)
        if first is not None or request.request_id in failed:
            victims.append(request)
            if first is not None:
                spoiled.update(b for ids in groups for b in ids[first:] if b)
    for request in scheduler.waiting:
        if (
            request.status == _REMOTE
            and _first_index(kv.get_block_ids(request.request_id), spoiled) is not None
        ):
            scheduler._failed_loads.add(request.request_id)
    kv.evict_blocks(spoiled)
    if victims:
        gone = {r.request_id for r in victims}
        scheduler.running = [r for r in scheduler.running if r.request_id not in gone]
        for request in reversed(victims):  # prepended: the first ends up first
            scheduler._preempt_request(request, counted=False)
        scheduler._recomputing |= gone
        scheduler._recomputing_news |= gone
    return [r.request_id for r in victims]
