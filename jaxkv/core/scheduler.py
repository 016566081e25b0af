"""The scheduler: continuous batching over a paged KV cache (vLLM V1 ``Scheduler``).

There are no prefill and decode phases. Each step every scheduled request advances its
``num_computed_tokens`` toward ``num_tokens_with_spec`` as far as the token budget allows:
running requests first (in order), then waiting ones (FCFS or priority). Chunked prefill,
prefix-cache hits and speculative tokens fall out of that one rule. When the pool runs dry
a running request is preempted by recompute (blocks freed, progress reset to 0, back to
the front of the waiting queue); no waiting request is admitted in a step that preempted.

With ``async_scheduling`` the engine calls ``schedule()`` for step N+1 before
``update_from_output`` of step N (vLLM's ``AsyncScheduler``): a request whose scheduled
tokens reach its end will sample one token, counted in ``num_output_placeholders`` until it
arrives, so the next schedule gives it that token's slot; a request whose token in flight is
its ``max_tokens``-th is not scheduled again. A token that arrives for a request preempted or
finished in between is dropped (it was never output; recompute samples it again).

With a KV connector (``kv_connector``: the scheduler side of a
``jaxkv.distributed.kv_transfer`` connector) a waiting request may get tokens from outside the
engine beyond its local prefix hit: loaded before the step (synchronous) or while it waits in
``WAITING_FOR_REMOTE_KVS`` holding its blocks (asynchronous; a failed load frees them and the
request recomputes, never asking the connector again). Loaded blocks are never listed for
zeroing. A finished request's blocks may be kept until the workers report them sent.

Construction: ``Scheduler(kv_cache_config, SchedulerConfig(...))`` or
``Scheduler(kv_cache_config, max_num_seqs=..., max_num_batched_tokens=..., max_model_len=...,
...)`` (keyword arguments are the fields of ``SchedulerConfig``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from jaxkv.kv_cache.specs import KVCacheConfig

from jaxkv.core.block_hash import get_hash_fn, get_request_block_hasher
from jaxkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from jaxkv.core.kv_events import KVEventBatch
from jaxkv.core.metrics import PrefixCachingMetrics, SchedulerStats
from jaxkv.core.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.request_queue import SchedulingPolicy, create_request_queue
from jaxkv.core.sched_output import NewRequestData, SchedulerOutput, make_cached_request_data
from jaxkv.core.scheduler_config import SchedulerConfig
from jaxkv.core.stop_check import append_and_check_stop

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler:
    """Host-side engine core: owns requests, queues and the KV-cache manager.

    Args:
        kv_cache_config: The pool and its groups (block 0 is the null block).
        scheduler_config: Settings; or pass ``SchedulerConfig`` fields as keywords.
        kv_connector: The scheduler side of a KV connector, or None.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        scheduler_config: SchedulerConfig | None = None,
        *,
        kv_connector=None,
        **kwargs,
    ):
        if scheduler_config is None:
            scheduler_config = SchedulerConfig(**kwargs)
        elif kwargs:
            raise TypeError(
                f"pass either a SchedulerConfig or keyword settings, not both: {sorted(kwargs)}"
            )
        self.scheduler_config = config = scheduler_config
        self.kv_cache_config = kv_cache_config
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.policy = config.policy
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.async_scheduling = config.async_scheduling

        self.kv_cache_manager = self._make_kv_cache_manager()
        self.block_size = self.kv_cache_manager.block_size
        self.num_kv_cache_groups = self.kv_cache_manager.num_kv_cache_groups
        self.block_hasher = None
        if self.kv_cache_manager.enable_caching:
            self.block_hasher = get_request_block_hasher(
                self.block_size, get_hash_fn(config.hash_algo)
            )

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        #: Finished or aborted since the last ``schedule()`` (told to the worker).
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.prefix_cache_metrics = PrefixCachingMetrics()
        self._kv_event_batches: list[KVEventBatch] = []
        #: Steps scheduled and not yet updated, each with the blocks its schedule put into
        #: the prefix cache (their KV is written by that step): evicted if the step fails.
        self._uncommitted: list[tuple[SchedulerOutput, list[int]]] = []
        self._scheduling = False  # True while schedule() runs (still True if it raised)
        self.num_hard_resets = 0  # recoveries that had to rebuild the KV-cache manager
        self.connector = kv_connector
        #: Asynchronous loads: req id -> (local hit, tokens valid once loaded) in tokens.
        self._remote_loads: dict[str, tuple[int, int]] = {}
        self._recved: set[str] = set()  # loads ended (reported by the workers)
        self._failed_loads: set[str] = set()  # of those, failed: recompute
        self._no_connector: set[str] = set()  # failed once: never asked again
        self._sending: dict[str, Request] = {}  # finished, blocks kept until sent
        self.num_external_computed_tokens = 0  # tokens loaded by the connector (stats)
        self.kv_connector_stats: dict = {}  # the workers' latest counters (driver rank's)
        self.num_failed_kv_loads = 0

    def _make_kv_cache_manager(self) -> KVCacheManager:
        config = self.scheduler_config
        return KVCacheManager(
            self.kv_cache_config,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            log_stats=config.log_stats,
            enable_kv_cache_events=config.enable_kv_cache_events,
            eviction_policy=config.eviction_policy,
            track_new_block_ids=True,
        )

    # ---- requests --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a new request. Raises ValueError (and changes nothing) if it can never run.

        Rejected: a duplicate live ``request_id``; a request that is not fresh; a prompt
        that leaves no room for output (``len(prompt) >= max_model_len``); a request whose
        longest possible sequence, ``min(len(prompt) + max_tokens, max_model_len)`` tokens,
        needs more blocks than the pool has (it could never finish).
        """
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"duplicate request id {req_id!r}: a live request already has it")
        if (
            request.status != _WAITING
            or request.num_computed_tokens != 0
            or request.num_output_tokens
        ):
            raise ValueError(f"request {req_id!r} is not fresh (status {request.status.name})")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no room for "
                f"output under max_model_len={self.max_model_len}"
            )
        max_len = int(min(request.num_prompt_tokens + request.max_tokens, self.max_model_len))
        needed = self.kv_cache_manager.max_blocks_per_request(
            max_len, self.max_num_scheduled_tokens, self.num_lookahead_tokens
        )
        usable = self.kv_cache_config.num_blocks - 1
        if needed > usable:
            raise ValueError(
                f"request {req_id!r} may grow to {max_len} tokens, which needs {needed} KV blocks, "
                f"but the pool has only {usable} usable blocks"
            )
        if self.block_hasher is not None:
            hasher = request.block_hasher
            if hasher is None:
                request.attach_block_hasher(self.block_hasher)
            elif getattr(hasher, "block_size", self.block_size) != self.block_size:
                raise ValueError(
                    f"request {req_id!r} hashes blocks of {hasher.block_size} tokens, the cache uses {self.block_size}"
                )
        if request.eos_token_id is None:
            request.eos_token_id = self.scheduler_config.eos_token_id
        self.requests[req_id] = request
        self.waiting.add_request(request)

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> list[str]:
        """Finishes live requests (abort by default) and frees their blocks.

        Unknown or already finished ids are ignored (an abort may race with a normal
        finish). Returns the ids that were finished now.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a finished status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        running_ids: set[str] = set()
        waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == _RUNNING:
                running_ids.add(req_id)
            else:
                waiting.append(request)
            request.status = finished_status
            finished.append(request)
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in finished:
            self._free_request(request)
        return [r.request_id for r in finished]

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """Aborts requests; returns one ``finish_reason="abort"`` output per aborted request."""
        num_cached = {}
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            if req_id in self.requests:
                num_cached[req_id] = max(self.requests[req_id].num_cached_tokens, 0)
        return [
            EngineCoreOutput(
                req_id, [], finish_reason="abort", num_cached_tokens=num_cached[req_id]
            )
            for req_id in self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        ]

    def _free_request(self, request: Request) -> dict | None:
        """Frees a finished request's blocks (unless the connector keeps them to send);
        returns the connector's ``kv_transfer_params`` for its output."""
        req_id = request.request_id
        self.finished_req_ids.add(req_id)
        delay, params = False, None
        if self.connector is not None:
            self.forget_kv_transfers(req_id)
            delay, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id)
            )
        if delay:
            self._sending[req_id] = request
        else:
            self.kv_cache_manager.free(request)
            del self.requests[req_id]
        return params

    def forget_kv_transfers(self, req_id: str | None = None) -> None:
        """Drops the KV-connector state of one request (None: of every request)."""
        for state in (self._remote_loads, self._sending):
            if req_id is None:
                state.clear()
            else:
                state.pop(req_id, None)
        for state in (self._recved, self._failed_loads, self._no_connector):
            if req_id is None:
                state.clear()
            else:
                state.discard(req_id)

    def has_pending_kv_sends(self) -> bool:
        """Finished requests whose blocks are kept until the connector reports them sent."""
        return bool(self._sending)

    def num_waiting_for_remote_kvs(self) -> int:
        return len(self._remote_loads)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    # ---- schedule --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decides this step's batch and reserves its KV slots (see module docstring)."""
        self._scheduling = True
        kv = self.kv_cache_manager
        allocate_slots = kv.allocate_slots
        threshold = self.scheduler_config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        lookahead = self.num_lookahead_tokens
        running = self.running

        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        token_budget = self.max_num_scheduled_tokens

        # 1) Running requests, in order.
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

        # 2) Waiting requests, unless something was preempted in this step.
        no_zero: set[int] = set()  # blocks a connector loads
        if not preempted_reqs:
            skipped: list[Request] = []
            chunked = self.scheduler_config.enable_chunked_prefill
            connector = self.connector
            while self.waiting and token_budget > 0 and len(running) < self.max_num_running_reqs:
                request = self.waiting.peek_request()
                fresh = request.num_computed_tokens == 0
                if request.status == _REMOTE:
                    loaded = self._finish_remote_load(request)
                    if loaded is None:
                        skipped.append(self.waiting.pop_request())  # its load is still in flight
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
                            skipped.append(self.waiting.pop_request())
                            continue
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
                        skipped.append(self.waiting.pop_request())
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
                self.waiting.pop_request()
                if load_async:
                    request.status = _REMOTE
                    self._remote_loads[request.request_id] = (num_local_computed, num_computed)
                    skipped.append(request)
                    continue
                running.append(request)
                if request.status == _WAITING:
                    scheduled_new_reqs.append(request)
                else:
                    scheduled_resumed_reqs.append(request)
                request.status = _RUNNING
                request.num_computed_tokens = num_computed
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed
                req_id = request.request_id
                req_to_new_blocks[req_id] = kv.get_blocks(req_id)
                num_scheduled_tokens[req_id] = num_new_tokens
                token_budget -= num_new_tokens
            if skipped:
                self.waiting.prepend_requests(skipped)

        total_num_scheduled_tokens = self.max_num_scheduled_tokens - token_budget
        if running:
            num_common_prefix_blocks = kv.get_num_common_prefix_blocks(running[0], len(running))
        else:
            num_common_prefix_blocks = [0] * self.num_kv_cache_groups
        new_reqs_data = [
            NewRequestData(
                req.request_id,
                req.prompt_token_ids,
                req.sampling_params,
                req_to_new_blocks[req.request_id].get_block_ids(),
                req.num_computed_tokens,
                req.pooling_params,
            )
            for req in scheduled_new_reqs
        ]
        cached_reqs_data = make_cached_request_data(
            scheduled_running_reqs, scheduled_resumed_reqs, num_scheduled_tokens, req_to_new_blocks
        )
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted_reqs},
            new_block_ids_to_zero=[b for b in kv.take_new_block_ids() if b not in no_zero]
            if no_zero
            else kv.take_new_block_ids(),
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._collect_stats_and_events()
        # Advance progress optimistically (before the forward pass), as vLLM.
        requests = self.requests
        async_scheduling = self.async_scheduling
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_tokens
            if request.spec_token_ids:
                request.spec_token_ids = []  # consumed (or stale once a token is sampled)
            if async_scheduling and (
                request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # this step samples its next token
        self.finished_req_ids = set()
        newly_cached = kv.take_newly_cached_block_ids()
        if num_scheduled_tokens:  # nothing scheduled: no step runs, nothing is updated
            self._uncommitted.append((output, newly_cached))
        self._scheduling = False
        return output

    # ---- KV connector ------------------------------------------------------------------------
    def _loaded_block_ids(
        self, request: Request, num_local: int, num_external: int, out: set[int]
    ) -> None:
        """Adds to ``out`` the request's blocks that hold any of its external tokens."""
        span = range(
            num_local // self.block_size, -(-(num_local + num_external) // self.block_size)
        )
        for ids in self.kv_cache_manager.get_block_ids(request.request_id):
            out.update(ids[i] for i in span if i < len(ids) and ids[i])

    def _finish_remote_load(self, request: Request) -> bool | None:
        """A request in WAITING_FOR_REMOTE_KVS whose load ended becomes WAITING: loaded (True),
        with its loaded blocks computed (the last prompt token is always recomputed, to sample)
        and cached; failed (False), with its blocks freed, to recompute from scratch. None:
        still in flight."""
        req_id = request.request_id
        if req_id not in self._recved:
            return None
        self._recved.discard(req_id)
        num_local, num_loaded = self._remote_loads.pop(req_id)
        request.status = _WAITING
        if req_id in self._failed_loads:
            self._failed_loads.discard(req_id)
            self._no_connector.add(req_id)
            self.num_failed_kv_loads += 1
            self.kv_cache_manager.free(request)  # not cached: nothing stale is shared
            request.num_computed_tokens = 0
            return False
        num_computed = min(num_loaded, request.num_tokens)
        if num_computed == request.num_tokens:
            num_computed -= 1
        self.kv_cache_manager.cache_blocks(request, num_computed)
        self.num_external_computed_tokens += num_computed - num_local
        request.num_computed_tokens = num_computed
        return True

    def _update_from_kv_xfer(self, out) -> None:
        """A step's ``KVConnectorOutput``: loads ended (failed ones by their blocks), sends done."""
        self.connector.update_connector_output(out)
        if out.stats:
            self.kv_connector_stats = out.stats
        self._recved |= out.finished_recving & self._remote_loads.keys()
        if out.invalid_block_ids:
            bad = out.invalid_block_ids
            for req_id in self._remote_loads:
                if any(
                    b in bad for ids in self.kv_cache_manager.get_block_ids(req_id) for b in ids
                ):
                    self._failed_loads.add(req_id)
        for req_id in out.finished_sending:
            request = self._sending.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
                del self.requests[req_id]

    def _pick_victim(self) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _collect_stats_and_events(self) -> None:
        kv = self.kv_cache_manager
        if kv.prefix_cache_stats is not None and (
            kv.prefix_cache_stats.requests or kv.prefix_cache_stats.reset
        ):
            self.prefix_cache_metrics.observe(kv.make_prefix_cache_stats())
        events = kv.take_events()
        if events:
            self._kv_event_batches.append(KVEventBatch(ts=time.time(), events=tuple(events)))

    # ---- results ---------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, rolls back rejected drafts, stops and frees finished requests.

        Returns one ``EngineCoreOutput`` per request that got tokens, prompt logprobs or
        finished. Requests finished or aborted since ``schedule()`` are skipped.
        """
        # The step ran: the KV of the blocks its schedule cached is written.
        self._uncommitted = [u for u in self._uncommitted if u[0] is not scheduler_output]
        if model_runner_output.kv_connector_output is not None and self.connector is not None:
            self._update_from_kv_xfer(model_runner_output.kv_connector_output)
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        pooler_output = model_runner_output.pooler_output
        spec_token_ids = model_runner_output.spec_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests
        outputs: list[EngineCoreOutput] = []
        stopped_ids: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue
            req_index = req_id_to_index.get(req_id)
            if req_index is None:
                raise ValueError(f"ModelRunnerOutput has no row for scheduled request {req_id!r}")
            generated = sampled_token_ids[req_index]
            scheduled_spec = spec_decode_tokens.get(req_id)
            if scheduled_spec:
                if not generated:
                    raise ValueError(f"request {req_id!r} verified drafts but sampled no token")
                request.num_computed_tokens -= len(scheduled_spec) + 1 - len(generated)
            new_token_ids = generated
            stopped = False
            if generated and request.num_output_placeholders:
                request.num_output_placeholders = max(
                    0, request.num_output_placeholders - len(generated)
                )
            if generated:
                if request.num_computed_tokens < request.num_tokens:
                    raise ValueError(
                        f"request {req_id!r} got sampled tokens {generated} for a partial prefill chunk "
                        f"({request.num_computed_tokens}/{request.num_tokens} tokens computed)"
                    )
                new_token_ids, stopped = append_and_check_stop(
                    request, generated, self.max_model_len
                )
            new_logprobs = None
            if logprobs is not None and new_token_ids:
                new_logprobs = logprobs[req_index][: len(new_token_ids)]
            prompt_logprobs = prompt_logprobs_dict.get(req_id) if prompt_logprobs_dict else None
            pooled = pooler_output.get(req_id) if pooler_output else None
            if pooled is not None and request.pooling_params is not None:
                request.status = RequestStatus.FINISHED_STOPPED  # pooling ends with its output
                stopped = True
            kv_params = None
            if stopped:
                stopped_ids.add(req_id)
                kv_params = self._free_request(request)
            elif spec_token_ids is not None:
                request.spec_token_ids = list(spec_token_ids[req_index])
            if new_token_ids or stopped or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        new_token_ids,
                        request.get_finished_reason(),
                        request.stop_reason,
                        new_logprobs,
                        prompt_logprobs,
                        request.num_cached_tokens,
                        pooled,
                        kv_params,
                    )
                )
        if stopped_ids:
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
        return outputs

    # ---- stats, events, cache ----------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        stats = kv.make_prefix_cache_stats()
        if stats is not None:
            self.prefix_cache_metrics.observe(stats)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_stats=stats,
            prefix_cache_hit_rate=self.prefix_cache_metrics.hit_rate,
            num_preemptions=self.num_preemptions,
        )

    def take_kv_events(self) -> list[KVEventBatch]:
        """KV-event batches collected by ``schedule()`` since the last call."""
        batches, self._kv_event_batches = self._kv_event_batches, []
        return batches

    def reset_prefix_cache(self) -> bool:
        """Clears the prefix cache; only succeeds when no request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()
