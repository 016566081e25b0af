"""Hypothesis state machine: random add / schedule+sample / abort / failed-step sequences on a tiny pool.

After every step it checks the block accounting: each block's ref count equals its number
of holders, free + held + null = total, no block is in two groups, and once no request is
alive every non-null block is free. The async variant keeps one step in flight (step N+1 is
scheduled before step N's tokens are applied) and also checks that no request gets more
than ``max_tokens`` outputs. A failed step (a schedule whose step never reports back, or
a schedule that raises part-way) is undone with ``recovery.abort_failed_steps``: afterwards
``consistency.scheduler_problems`` is empty and no block cached by a failed schedule (or by
the step in flight) is still in the prefix cache.
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.core import ModelRunnerOutput, Request, Scheduler
from jaxkv.core.async_scheduler import AsyncScheduler
from jaxkv.core.consistency import scheduler_problems
from jaxkv.core.recovery import abort_failed_steps
from jaxkv.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from jaxkv.sampling_params import SamplingParams

EOS = 5
BLOCK_SIZE = 4
PREFIXES = [[1, 2, 3, 4, 1, 2, 3, 4], [0, 0, 0, 0, 1, 1, 1, 1], [3, 1, 4, 1, 5, 9, 2, 6]]


def _config(hybrid: bool, num_blocks: int) -> KVCacheConfig:
    full = FullAttentionSpec(BLOCK_SIZE, 1, 8, "float32")
    groups = [KVCacheGroupSpec(("full",), full)]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(
                ("local",), SlidingWindowSpec(BLOCK_SIZE, 1, 8, "float32", sliding_window=6)
            )
        )
    return KVCacheConfig(num_blocks, (), groups)


class SchedulerMachine(RuleBasedStateMachine):
    hybrid = True
    policy = "fcfs"
    eviction_policy = "lru"
    num_blocks = 17  # 16 usable: one 40-token request needs 10 full + 6 window blocks
    async_scheduling = False

    def __init__(self):
        super().__init__()
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(
            _config(self.hybrid, self.num_blocks),
            max_num_seqs=4,
            max_num_batched_tokens=12,
            max_model_len=40,
            policy=self.policy,
            eviction_policy=self.eviction_policy,
            eos_token_id=EOS,
            async_scheduling=self.async_scheduling,
        )
        self.next_id = 0
        self.num_steps = 0
        self.in_flight = None  # async: (SchedulerOutput, ModelRunnerOutput) not applied yet

    @rule(
        prefix=st.sampled_from(PREFIXES),
        prefix_len=st.integers(0, 8),
        tail=st.lists(st.integers(0, 9), min_size=1, max_size=16),
        max_tokens=st.integers(1, 16),
        priority=st.integers(0, 2),
    )
    def add(self, prefix, prefix_len, tail, max_tokens, priority):
        request = Request(
            f"r{self.next_id}",
            prefix[:prefix_len] + tail,
            SamplingParams(max_tokens=max_tokens),
            priority=priority,
            arrival_time=float(self.next_id),
        )
        self.next_id += 1
        self.scheduler.add_request(request)

    def _cached_entries(self) -> set:
        cache = self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
        return {
            (key, b.block_id)
            for key, entry in cache.items()
            for b in (entry.values() if isinstance(entry, dict) else (entry,))
        }

    @rule(mid_schedule=st.booleans(), on_call=st.integers(1, 3))
    def failed_step(self, mid_schedule, on_call):
        s = self.scheduler
        before = self.in_flight[2] if self.in_flight else self._cached_entries()
        live_before = set(s.requests)
        if mid_schedule:  # allocate_slots raises on its on_call-th call
            kv, calls = s.kv_cache_manager, [0]
            real = kv.allocate_slots

            def allocate(*args, **kwargs):
                calls[0] += 1
                if calls[0] == on_call:
                    raise RuntimeError("injected")
                return real(*args, **kwargs)

            kv.allocate_slots = allocate
            try:
                s.schedule()
            except RuntimeError:
                pass
            finally:
                del kv.allocate_slots
        else:
            out = s.schedule()  # its step never reports back
            assert set(out.num_scheduled_tokens) <= live_before
        aborted = abort_failed_steps(s)
        self.in_flight = None
        assert set(aborted) <= live_before and not set(aborted) & set(s.requests)
        assert scheduler_problems(s) == []
        assert s.num_hard_resets == 0, "recovery missed something and rebuilt the KV manager"
        assert self._cached_entries() <= before, "a block cached by a failed step is still cached"

    @rule(tokens=st.lists(st.integers(0, 9), min_size=8, max_size=8))
    def step(self, tokens):
        s = self.scheduler
        snapshot = self._cached_entries() if self.async_scheduling else None
        out = s.schedule()
        self.num_steps += 1
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 12
        assert len(s.running) <= 4
        assert not (set(out.num_scheduled_tokens) & out.preempted_req_ids)
        sampled = {}
        for i, req_id in enumerate(out.num_scheduled_tokens):
            request = s.requests[req_id]
            if self.async_scheduling:  # the placeholder this schedule added sits right after
                ph = request.num_output_placeholders
                done = ph > 0 and request.num_computed_tokens == request.num_tokens + ph - 1
            else:
                done = request.num_computed_tokens >= request.num_tokens
            sampled[req_id] = [tokens[i % len(tokens)]] if done else []
        mro = ModelRunnerOutput.from_sampled(sampled)
        if self.async_scheduling:
            prev, self.in_flight = self.in_flight, (out, mro, snapshot)
            results = s.update_from_output(*prev[:2]) if prev else []
        else:
            results = s.update_from_output(out, mro)
        for res in results:
            request = s.requests.get(res.request_id)
            if request is not None:
                assert request.num_output_tokens <= request.max_tokens
        for request in s.running:
            extra = max(request.num_output_placeholders - 1, 0)
            assert request.num_computed_tokens <= request.num_tokens + extra
            assert request.num_output_placeholders <= (2 if self.async_scheduling else 0)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        assert self.scheduler.finish_requests(req_id) == [req_id]

    @invariant()
    def block_accounting(self):
        s = self.scheduler
        pool = s.kv_cache_manager.block_pool
        holders: Counter = Counter()
        owner_group: dict[int, int] = {}
        for group_id, manager in enumerate(s.kv_cache_manager.single_type_managers):
            for req_id, blocks in manager.req_to_blocks.items():
                assert req_id in s.requests, f"freed request {req_id} still holds blocks"
                for block in blocks:
                    if block.is_null:
                        continue
                    holders[block.block_id] += 1
                    assert owner_group.setdefault(block.block_id, group_id) == group_id, (
                        "block in two groups"
                    )
        free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        assert len(free) == pool.get_num_free_blocks()
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
            assert (block.block_id in free) == (block.ref_cnt == 0)
        assert 0 not in free
        assert len(free) + len(holders) + 1 == pool.num_gpu_blocks
        alive = {r.request_id for r in s.running} | {r.request_id for r in s.waiting}
        assert alive == set(s.requests)
        if not s.requests:
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert scheduler_problems(s) == []

    def teardown(self):
        # Drain: everything finishes or is aborted, and no block leaks.
        s = self.scheduler
        for _ in range(200):
            if not s.has_unfinished_requests() and self.in_flight is None:
                break
            if not s.has_unfinished_requests():  # async: apply the last step in flight
                s.update_from_output(*self.in_flight[:2])
                self.in_flight = None
            else:
                self.step([EOS - 1] * 8)
            self.block_accounting()
        s.finish_requests(list(s.requests))
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == self.num_blocks - 1


PROFILE = settings(max_examples=40, stateful_step_count=40, derandomize=True, deadline=None)


class FullAttentionPriorityMachine(SchedulerMachine):
    hybrid = False
    policy = "priority"
    eviction_policy = "lru_unhashed_first"
    num_blocks = 11  # 10 usable blocks = 40 tokens


class AsyncHybridMachine(SchedulerMachine):
    async_scheduling = True


SchedulerMachine.TestCase.settings = PROFILE
FullAttentionPriorityMachine.TestCase.settings = PROFILE
AsyncHybridMachine.TestCase.settings = PROFILE
TestHybridFCFS = SchedulerMachine.TestCase
TestFullAttentionPriority = FullAttentionPriorityMachine.TestCase
TestAsyncHybridFCFS = AsyncHybridMachine.TestCase
