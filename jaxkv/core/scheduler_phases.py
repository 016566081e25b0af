"""The two phases of ``Scheduler.schedule()``: running requests, then waiting requests.

Both phases fill one ``StepPlan`` (the batch decided so far and the token budget left).
The running phase advances every running request, in order, as far as the budget allows,
preempting (``Scheduler._pick_victim``) when the pool runs dry. The waiting phase admits
waiting requests (FCFS or priority) while budget and ``max_num_seqs`` allow; it does not
run in a step that preempted. A KV connector may give a waiting request tokens beyond its
local prefix hit: loaded before the step (synchronous) or while it waits in
``WAITING_FOR_REMOTE_KVS`` holding its blocks (asynchronous; see ``scheduler_kv_transfer``).
"""

from __future__ import annotations

import dataclasses

from jaxkv.core.failed_loads import loaded_tail
from jaxkv.core.kv_cache_manager import KVCacheBlocks
from jaxkv.core.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclasses.dataclass(slots=True)
class StepPlan:
    """What one ``schedule()`` has decided so far.

    Attributes:
        token_budget: Tokens the step may still schedule.
        scheduled_new_reqs: Admitted for the first time, in order.
        scheduled_resumed_reqs: Admitted again after a preemption, in order.
        scheduled_running_reqs: Running requests that advance this step, in order.
        preempted_reqs: Preempted by this step (no waiting request is admitted then).
        req_to_new_blocks: ``req_id ->`` its blocks (new ones; all of them when admitted).
        num_scheduled_tokens: ``req_id ->`` tokens it computes this step.
        scheduled_spec_decode_tokens: ``req_id ->`` the draft tokens it verifies this step.
        no_zero: Blocks a KV connector loads: never listed for zeroing.
    """

    token_budget: int
    scheduled_new_reqs: list[Request] = dataclasses.field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = dataclasses.field(default_factory=list)
    scheduled_running_reqs: list[Request] = dataclasses.field(default_factory=list)
    preempted_reqs: list[Request] = dataclasses.field(default_factory=list)
    req_to_new_blocks: dict[str, KVCacheBlocks] = dataclasses.field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    no_zero: set[int] = dataclasses.field(default_factory=set)


class SchedulePhasesMixin:
    """``Scheduler``'s running and waiting phases (they read and change its state)."""

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests, in order: each advances toward ``num_tokens_with_spec`` (plus
        its token in flight, with async scheduling) as far as the budget allows; when its
        slots do not fit, victims are preempted until they do (or it is the victim)."""
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self.scheduler_config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        lookahead = self.num_lookahead_tokens
        running = self.running
        scheduled_running_reqs = plan.scheduled_running_reqs
        preempted_reqs = plan.preempted_reqs
        req_to_new_blocks = plan.req_to_new_blocks
        num_scheduled_tokens = plan.num_scheduled_tokens
        scheduled_spec_decode_tokens = plan.scheduled_spec_decode_tokens
        token_budget = plan.token_budget

        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if placeholders and request.num_output_tokens + placeholders >= request.max_tokens:
                req_index += 1  # the token in flight is its last: no step after it
                continue
            num_new_tokens = request.num_tokens_with_spec + placeholders - num_computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, token_budget, max_model_len - 1 - num_computed)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = allocate_slots(request, num_new_tokens, num_lookahead_tokens=lookahead)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                victim_index = (
                    running.index(victim) if victim is not running[-1] else len(running) - 1
                )
                running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1
                    vid = victim.request_id
                    if vid in num_scheduled_tokens:
                        # Already scheduled this step: give back its budget (as vLLM > v0.11).
                        scheduled_running_reqs.remove(victim)
                        token_budget += num_scheduled_tokens.pop(vid)
                        del req_to_new_blocks[vid]
                        scheduled_spec_decode_tokens.pop(vid, None)
                self._preempt_request(victim)
                preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request itself was preempted
            req_id = request.request_id
            scheduled_running_reqs.append(request)
            req_to_new_blocks[req_id] = new_blocks
            num_scheduled_tokens[req_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            if request.spec_token_ids:
                num_spec = num_new_tokens + num_computed - request.num_tokens
                if num_spec > 0:
                    scheduled_spec_decode_tokens[req_id] = request.spec_token_ids[:num_spec]
        plan.token_budget = token_budget

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Waiting requests, in queue order, while budget and ``max_num_seqs`` allow: each
        gets its prefix-cache hit and the connector's tokens, then slots for the rest of its
        prompt (a chunk of it with chunked prefill). The head of line that does not fit
        stops admission; requests passed over keep their place at the front of the queue."""
        kv = self.kv_cache_manager
        allocate_slots = kv.allocate_slots
        threshold = self.scheduler_config.long_prefill_token_threshold
        lookahead = self.num_lookahead_tokens
        running = self.running
        waiting = self.waiting
        req_to_new_blocks = plan.req_to_new_blocks
        num_scheduled_tokens = plan.num_scheduled_tokens
        no_zero = plan.no_zero
        token_budget = plan.token_budget
        skipped: list[Request] = []
        chunked = self.scheduler_config.enable_chunked_prefill
        connector = self.connector
        while waiting and token_budget > 0 and len(running) < self.max_num_running_reqs:
            request = waiting.peek_request()
            if self._recomputing and request.request_id in self._recomputing:
                if self._in_flight(request.request_id):
                    skipped.append(waiting.pop_request())  # its old step's results come first
                    continue
                self._recomputing.discard(request.request_id)
            fresh = request.num_computed_tokens == 0
            if request.status == _REMOTE:
                loaded = self._finish_remote_load(request)
                if loaded is None:
                    skipped.append(waiting.pop_request())  # its load is still in flight
                    continue
                fresh = not loaded  # failed: its blocks were freed, it starts afresh
            num_external, load_async = 0, False
            if fresh:
                computed_blocks, num_local_computed = kv.get_computed_blocks(request)
                if connector is not None and request.request_id not in self._no_connector:
                    num_external, load_async = connector.get_num_new_matched_tokens(
                        request, num_local_computed
                    )
                    if num_external is None:  # the connector asks to wait
                        skipped.append(waiting.pop_request())
                        continue
                    if not load_async:  # the last prompt token is computed, to sample
                        num_external = max(
                            0, min(num_external, request.num_tokens - 1 - num_local_computed)
                        )
            else:
                computed_blocks, num_local_computed = None, 0
            num_computed = request.num_computed_tokens + num_local_computed + num_external
            if load_async:
                num_new_tokens = 0  # nothing computed until the load ends
            else:
                num_new_tokens = request.num_tokens - num_computed
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if not chunked and num_new_tokens > token_budget:
                    skipped.append(waiting.pop_request())
                    continue
                num_new_tokens = min(num_new_tokens, token_budget)
            new_blocks = allocate_slots(
                request,
                num_new_tokens + num_external,
                num_local_computed,
                computed_blocks,
                num_lookahead_tokens=0 if request.num_computed_tokens == 0 else lookahead,
                delay_cache_blocks=load_async,
            )
            if new_blocks is None:
                break  # head of line cannot fit: stop admitting
            if connector is not None:
                connector.update_state_after_alloc(
                    request, kv.get_blocks(request.request_id), num_external
                )
                if num_external:  # loaded pages are never zeroed
                    self._loaded_block_ids(request, num_local_computed, num_external, no_zero)
                    if not load_async:
                        self.num_external_computed_tokens += num_external
                        self._sync_loads[request.request_id] = loaded_tail(
                            kv.get_block_ids(request.request_id),
                            num_local_computed,
                            self.block_size,
                        )
            waiting.pop_request()
            if load_async:
                request.status = _REMOTE
                self._remote_loads[request.request_id] = (num_local_computed, num_computed)
                skipped.append(request)
                continue
            running.append(request)
            if request.status == _WAITING:
                plan.scheduled_new_reqs.append(request)
            else:
                plan.scheduled_resumed_reqs.append(request)
            request.status = _RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            req_id = request.request_id
            req_to_new_blocks[req_id] = kv.get_blocks(req_id)
            num_scheduled_tokens[req_id] = num_new_tokens
            token_budget -= num_new_tokens
        if skipped:
            waiting.prepend_requests(skipped)
        plan.token_budget = token_budget
