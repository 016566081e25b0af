"""The scheduler: continuous batching over a paged KV cache (vLLM V1 ``Scheduler``).

There are no prefill and decode phases. Each step every scheduled request advances its
``num_computed_tokens`` toward ``num_tokens_with_spec`` as far as the token budget allows:
running requests first (in order), then waiting ones (FCFS or priority). Chunked prefill,
prefix-cache hits and speculative tokens fall out of that one rule. When the pool runs dry
a running request is preempted by recompute (blocks freed, progress reset to 0, back to
the front of the waiting queue); no waiting request is admitted in a step that preempted.

The class is assembled from parts: the two phases of ``schedule()`` are in
``scheduler_phases``, ``update_from_output`` in ``scheduler_update``, the KV connector's
loads and sends in ``scheduler_kv_transfer``. With ``async_scheduling`` (``schedule()`` for
step N+1 before ``update_from_output`` of step N) the scheduler is an ``AsyncScheduler``
(``async_scheduler``): build that class when the settings ask for async scheduling
(``Scheduler`` refuses them).

Construction: ``Scheduler(kv_cache_config, SchedulerConfig(...))`` or
``Scheduler(kv_cache_config, max_num_seqs=..., max_num_batched_tokens=..., max_model_len=...,
...)`` (keyword arguments are the fields of ``SchedulerConfig``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from jaxkv.core.block_hash import get_hash_fn, get_request_block_hasher
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.kv_events import KVEventBatch
from jaxkv.core.metrics import PrefixCachingMetrics, SchedulerStats
from jaxkv.core.outputs import EngineCoreOutput
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.request_queue import SchedulingPolicy, create_request_queue
from jaxkv.core.sched_output import NewRequestData, SchedulerOutput, make_cached_request_data
from jaxkv.core.scheduler_config import SchedulerConfig
from jaxkv.core.scheduler_kv_transfer import KVTransferMixin
from jaxkv.core.scheduler_phases import SchedulePhasesMixin, StepPlan
from jaxkv.core.scheduler_update import SchedulerUpdateMixin
from jaxkv.kv_cache.specs import KVCacheConfig

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING


class Scheduler(SchedulePhasesMixin, KVTransferMixin, SchedulerUpdateMixin):
    """Host-side engine core: owns requests, queues and the KV-cache manager.

    Args:
        kv_cache_config: The pool and its groups (block 0 is the null block).
        scheduler_config: Settings; or pass ``SchedulerConfig`` fields as keywords.
        kv_connector: The scheduler side of a KV connector, or None.
    """

    #: Whether this class counts the tokens of steps in flight (``AsyncScheduler`` does).
    supports_async_scheduling = False

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
        if scheduler_config.async_scheduling and not self.supports_async_scheduling:
            raise ValueError(
                "async_scheduling=True needs jaxkv.core.async_scheduler.AsyncScheduler, "
                "not Scheduler"
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
        #: Reported sent while still running (its offer expired before the step's update
        #: finished it): freed at once when it finishes.
        self._sent_early: set[str] = set()
        self.num_external_computed_tokens = 0  # tokens loaded by the connector (stats)
        self.kv_connector_stats: dict = {}  # the workers' latest counters (every rank's)
        self.num_failed_kv_loads = 0
        #: Synchronous loads until their step's results: req id -> blocks they may spoil.
        self._sync_loads: dict[str, list[list[int]]] = {}
        #: Sent back to recompute by a failed synchronous load (see ``failed_loads``): told
        #: to the runner as preempted by the next schedule; not re-admitted while a step in
        #: flight still contains them.
        self._recomputing: set[str] = set()
        self._recomputing_news: set[str] = set()

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
                request_id=req_id,
                new_token_ids=[],
                finish_reason="abort",
                num_cached_tokens=num_cached[req_id],
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
            sent = req_id in self._sent_early
            self.forget_kv_transfers(req_id)
            delay, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id)
            )
            delay = delay and not sent
        if delay:
            self._sending[req_id] = request
        else:
            self.kv_cache_manager.free(request)
            del self.requests[req_id]
        return params

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
        plan = StepPlan(token_budget=self.max_num_scheduled_tokens)
        self._schedule_running(plan)  # 1) running requests, in order
        if not plan.preempted_reqs:  # 2) waiting ones, unless something was preempted
            self._schedule_waiting(plan)

        running = self.running
        if running:
            num_common_prefix_blocks = kv.get_num_common_prefix_blocks(running[0], len(running))
        else:
            num_common_prefix_blocks = [0] * self.num_kv_cache_groups
        req_to_new_blocks = plan.req_to_new_blocks
        new_reqs_data = [
            NewRequestData(
                req.request_id,
                req.prompt_token_ids,
                req.sampling_params,
                req_to_new_blocks[req.request_id].get_block_ids(),
                req.num_computed_tokens,
                req.pooling_params,
            )
            for req in plan.scheduled_new_reqs
        ]
        cached_reqs_data = make_cached_request_data(
            plan.scheduled_running_reqs,
            plan.scheduled_resumed_reqs,
            plan.num_scheduled_tokens,
            req_to_new_blocks,
        )
        no_zero = plan.no_zero
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - plan.token_budget,
            scheduled_spec_decode_tokens=plan.scheduled_spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted_reqs}
            | self._take_recomputing(),
            new_block_ids_to_zero=[b for b in kv.take_new_block_ids() if b not in no_zero]
            if no_zero
            else kv.take_new_block_ids(),
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._collect_stats_and_events()
        self._update_after_schedule(output)
        self.finished_req_ids = set()
        newly_cached = kv.take_newly_cached_block_ids()
        if output.num_scheduled_tokens:  # nothing scheduled: no step runs, nothing is updated
            self._uncommitted.append((output, newly_cached))
        self._scheduling = False
        return output

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advances the scheduled requests' progress optimistically (before the forward
        pass, as vLLM); their draft tokens are consumed."""
        requests = self.requests
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_tokens
            if request.spec_token_ids:
                request.spec_token_ids = []  # consumed (or stale once a token is sampled)

    def _pick_victim(self) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_request(self, request: Request, *, counted: bool = True) -> None:
        """Frees the request's blocks and puts it at the front of the waiting queue to
        recompute; ``counted=False`` for a recompute that is not a preemption (stats)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        if counted:
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
