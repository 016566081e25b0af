"""What the scheduler tells the worker each step (``SchedulerOutput``), as vLLM's ``sched/output``.

Block ids are per KV-cache group: ``block_ids[g]`` is the request's block table row for
group ``g``. A block id belongs to one group at a time, so ids can index every group's
buffer. Sliding-window groups contain ``NULL_BLOCK_ID`` (0) where blocks were dropped.
"""

from __future__ import annotations

import dataclasses

from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    """A request the worker has not seen before (first scheduling).

    Attributes:
        req_id: Request id.
        prompt_token_ids: The prompt.
        sampling_params: Its sampling parameters.
        block_ids: Per group, all its blocks (prefix hit + new).
        num_computed_tokens: Tokens already in the cache (the prefix hit): the position
            this step starts at.
        pooling_params: Set for a pooling request (the worker returns its pooled hidden
            states when its prompt is done, and no token).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None


@dataclasses.dataclass
class CachedRequestData:
    """Requests the worker has seen: running ones first, then ones resumed from preemption.

    Index ``i`` of every list describes ``req_ids[i]``.

    Attributes:
        req_ids: Request ids.
        resumed_from_preemption: True if the request was preempted and is scheduled again;
            its ``new_block_ids`` then *replace* the worker's block lists and its token ids
            are in ``all_token_ids``.
        new_token_ids: The non-speculative token ids this step feeds, i.e.
            ``all_token_ids[num_computed_tokens : min(num_computed_tokens + n, num_tokens)]``
            (for a decode step, the token sampled last step).
        new_block_ids: Per request, per group, the blocks appended this step, or None when
            no group got one (for resumed requests: the full block lists).
        num_computed_tokens: Start position of this step per request.
        all_token_ids: ``req_id -> prompt + output tokens``, for resumed requests only.
    """

    req_ids: list[str]
    resumed_from_preemption: list[bool]
    new_token_ids: list[list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    all_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], [], [], [], [])


@dataclasses.dataclass
class SchedulerOutput:
    """One step's schedule: the boundary between the host core and the worker.

    Attributes:
        scheduled_new_reqs: Requests scheduled for the first time.
        scheduled_cached_reqs: Running and resumed requests.
        num_scheduled_tokens: ``req_id -> tokens computed this step`` (speculative included).
        total_num_scheduled_tokens: Sum of ``num_scheduled_tokens`` (<= max_num_batched_tokens).
        scheduled_spec_decode_tokens: ``req_id -> draft tokens`` verified this step (only
            requests that have some). They are the last ``len(drafts)`` of its scheduled
            tokens.
        num_common_prefix_blocks: Per group, leading blocks shared by all running requests.
        finished_req_ids: Requests that finished or were aborted since the previous step;
            the worker drops their state.
        preempted_req_ids: Requests preempted in this step (their blocks are freed; they will
            come back with ``resumed_from_preemption``).
        new_block_ids_to_zero: Blocks handed out this step (each once) that the worker must
            zero before use. Prefix-hit blocks are not listed (their contents are valid),
            nor are blocks a KV connector loads (loaded pages are never re-zeroed).
        kv_connector_metadata: The scheduler-side KV connector's ``build_connector_meta``
            for this step (None without a connector); the workers bind it around the step.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    new_block_ids_to_zero: list[int]
    kv_connector_metadata: object = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0, {}, [], set(), set(), [])


def make_cached_request_data(
    running_reqs, resumed_reqs, num_scheduled_tokens, req_to_new_blocks
) -> CachedRequestData:
    """Builds ``CachedRequestData``: running requests (new blocks only), then resumed ones.

    Args:
        running_reqs: Scheduled requests that were running (``num_computed_tokens`` is the
            step's start position: progress is advanced after this is built).
        resumed_reqs: Requests resumed from preemption this step.
        num_scheduled_tokens: ``req_id -> tokens this step``.
        req_to_new_blocks: ``req_id -> KVCacheBlocks`` (new blocks for running requests,
            all blocks for resumed ones).
    """
    req_ids: list[str] = []
    new_token_ids: list[list[int]] = []
    new_block_ids: list[tuple[list[int], ...] | None] = []
    num_computed_tokens: list[int] = []
    all_token_ids: dict[str, list[int]] = {}
    for req in running_reqs:
        req_id = req.request_id
        start = req.num_computed_tokens
        req_ids.append(req_id)
        new_token_ids.append(req.all_token_ids[start : start + num_scheduled_tokens[req_id]])
        groups = req_to_new_blocks[req_id].blocks
        if len(groups) == 1:  # fast path for the common single-group case
            new_block_ids.append(([b.block_id for b in groups[0]],) if groups[0] else None)
        else:
            new_block_ids.append(req_to_new_blocks[req_id].get_block_ids(allow_none=True))
        num_computed_tokens.append(start)
    for req in resumed_reqs:
        req_id = req.request_id
        start = req.num_computed_tokens
        req_ids.append(req_id)
        new_token_ids.append(req.all_token_ids[start : start + num_scheduled_tokens[req_id]])
        new_block_ids.append(req_to_new_blocks[req_id].get_block_ids())
        num_computed_tokens.append(start)
        all_token_ids[req_id] = list(req.all_token_ids)
    resumed = [False] * len(running_reqs) + [True] * len(resumed_reqs)
    return CachedRequestData(
        req_ids, resumed, new_token_ids, new_block_ids, num_computed_tokens, all_token_ids
    )
