"""Undoing a failed step on the host side: abort its requests, un-cache unwritten blocks.

A step can fail anywhere: in ``Scheduler.schedule``, while the worker prepares or runs it,
while its results are collected or while the engine turns them into outputs (an exception,
or a KeyboardInterrupt). The scheduler has by then reserved blocks for the step's requests,
advanced their progress and, as vLLM does, put their full blocks into the prefix cache at
allocation, before the step writes their KV. ``abort_failed_steps`` makes the state valid
again:

1. every request of a step that was scheduled and not updated (``update_from_output``
   never ran for it), every request named by the caller, and, when ``schedule`` itself
   raised, every request that holds blocks or sits in no queue (but finished requests whose
   blocks a KV connector keeps for a send), is finished as aborted and its blocks are
   freed; the KV connector hears of each (``request_finished``) so it drops what it kept
   for it, and whatever it answers the blocks are freed (their KV may be unwritten);
2. every block that those schedules put into the prefix cache is evicted from it (its KV
   may never have been written: it must never be served as a hit);
3. ``consistency.scheduler_problems`` is checked; if anything is still broken (an
   interrupt landed inside a data-structure update), every request is aborted and the
   KV-cache manager is rebuilt empty. The engine is usable again either way.

``drop_all_kv`` is for the worse case where the KV buffers themselves were lost (a donated
buffer whose step failed): every running request goes back to waiting (recompute, as a
preemption) and the prefix cache is emptied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from jaxkv.core.consistency import scheduler_problems
from jaxkv.core.request import RequestStatus
from jaxkv.core.request_queue import create_request_queue

_ABORTED = RequestStatus.FINISHED_ABORTED
logger = logging.getLogger(__name__)


def affected_request_ids(scheduler, extra: Iterable[str] = ()) -> set[str]:
    """Live requests a failed step takes down (rule 1 of the module docstring)."""
    ids = {r for r in extra if r in scheduler.requests}
    for so, _ in scheduler._uncommitted:
        ids.update(r for r in so.num_scheduled_tokens if r in scheduler.requests)
    queued = {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
    queued |= scheduler._sending.keys()  # finished, kept for a send: in no queue by design
    ids.update(r for r in scheduler.requests if r not in queued)  # lost between two queues
    if scheduler._scheduling:  # schedule() raised part-way: anything it touched
        ids.update(r.request_id for r in scheduler.running)
        for manager in scheduler.kv_cache_manager.single_type_managers:
            ids.update(r for r, blocks in manager.req_to_blocks.items() if blocks)
        ids.update(r.request_id for r in scheduler.waiting if r.num_computed_tokens)
    return ids & set(scheduler.requests)


def abort_failed_steps(scheduler, extra: Iterable[str] = ()) -> list[str]:
    """Aborts what failed steps leave behind (see the module docstring); returns the ids
    of the requests aborted, in no particular order."""
    ids = affected_request_ids(scheduler, extra)
    unwritten = [b for _, blocks in scheduler._uncommitted for b in blocks]
    unwritten += scheduler.kv_cache_manager.take_newly_cached_block_ids()
    scheduler._uncommitted = []
    scheduler._scheduling = False
    try:
        remove_requests(scheduler, ids)
        scheduler.kv_cache_manager.evict_blocks(unwritten)
        problems = scheduler_problems(scheduler)
    except Exception as exc:  # noqa: BLE001 - a structure too broken to walk: rebuild it
        problems = [f"recovery raised {exc!r}"]
    if problems:
        ids |= set(scheduler.requests)
        reset_scheduler(scheduler)
    return sorted(ids)


def remove_requests(scheduler, ids: set[str]) -> None:
    """Finishes the live requests ``ids`` as aborted wherever they are (a queue, or none)
    and frees their blocks; unlike ``finish_requests`` it does not assume the queues are
    consistent."""
    if not ids:
        return
    scheduler.running = [r for r in scheduler.running if r.request_id not in ids]
    in_waiting = [r for r in scheduler.waiting if r.request_id in ids]
    if in_waiting:
        scheduler.waiting.remove_requests(in_waiting)
    for req_id in ids:
        request = scheduler.requests.pop(req_id)
        request.status = _ABORTED
        scheduler.finished_req_ids.add(req_id)
        _tell_connector(scheduler, request)
        scheduler.kv_cache_manager.free(request)
        scheduler.forget_kv_transfers(req_id)


def _tell_connector(scheduler, request) -> None:
    """``request_finished`` for a request recovery aborts, unless the connector heard of it
    when it finished (it is kept for a send); its answer is ignored (the blocks are freed)
    and its failure logged: recovery must finish."""
    if scheduler.connector is None or request.request_id in scheduler._sending:
        return
    try:
        scheduler.connector.request_finished(
            request, scheduler.kv_cache_manager.get_block_ids(request.request_id)
        )
    except Exception:
        logger.exception(
            "KV connector request_finished failed for aborted request %r", request.request_id
        )


def reset_scheduler(scheduler) -> None:
    """Aborts every request and rebuilds an empty KV-cache manager (cache and pool)."""
    for req_id, request in scheduler.requests.items():
        request.status = _ABORTED
        scheduler.finished_req_ids.add(req_id)
        _tell_connector(scheduler, request)
    scheduler.requests = {}
    scheduler.running = []
    scheduler.waiting = create_request_queue(scheduler.policy)
    scheduler.kv_cache_manager = scheduler._make_kv_cache_manager()
    scheduler._uncommitted = []
    scheduler._scheduling = False
    scheduler.forget_kv_transfers()
    scheduler.num_hard_resets += 1


def drop_all_kv(scheduler) -> list[str]:
    """The KV buffers were lost: every running request is preempted (recomputed when it is
    scheduled again; its tokens so far are kept) and the prefix cache is emptied. Returns
    the ids preempted."""
    preempted = [r.request_id for r in scheduler.running]
    for request in reversed(scheduler.running):  # prepended: the first ends up first
        scheduler._preempt_request(request)
    scheduler.running = []
    if not scheduler.kv_cache_manager.reset_prefix_cache():
        reset_scheduler(scheduler)  # something still holds blocks: start from nothing
    return preempted
