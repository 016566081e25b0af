"""Async scheduling in the host core: step N+1 is scheduled before step N's tokens arrive.

The driver below plays an engine with one step in flight: ``schedule()`` for step N+1, then
``update_from_output`` for step N. The sampled tokens of a step are decided when it is
scheduled (the rows that caught up), as a device would sample them.
"""

import pytest

from jaxkv.core import ModelRunnerOutput, RequestStatus, Scheduler, SchedulerConfig
from jaxkv.core.async_scheduler import AsyncScheduler
from tests.core.conftest import full_spec, make_config
from tests.core.test_scheduler import make_scheduler


def sampled_rows(scheduler, out, token_fn):
    """The tokens the step scheduled as ``out`` samples: one per row that caught up."""
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        r = scheduler.requests[req_id]
        # caught up: the placeholder this schedule added is the last position computed + 1
        caught_up = (
            r.num_output_placeholders
            and r.num_computed_tokens == r.num_tokens + r.num_output_placeholders - 1
        )
        sampled[req_id] = (
            [token_fn(req_id, r.num_output_tokens + r.num_output_placeholders - 1)]
            if caught_up
            else []
        )
    return ModelRunnerOutput.from_sampled(sampled)


class Pipeline:
    """One step in flight: ``step()`` schedules N+1, then applies N's output."""

    def __init__(self, scheduler, token_fn=lambda req_id, i: 7):
        self.s, self.token_fn, self.in_flight = scheduler, token_fn, None
        self.scheduled: list[dict] = []

    def step(self):
        out = self.s.schedule()
        self.scheduled.append(dict(out.num_scheduled_tokens))
        mro = sampled_rows(self.s, out, self.token_fn)
        prev, self.in_flight = self.in_flight, (out, mro)
        return self.s.update_from_output(*prev) if prev else []

    def drain(self, limit=100):
        results = []
        for _ in range(limit):
            if not self.s.has_unfinished_requests() and self.in_flight is None:
                break
            if not self.s.has_unfinished_requests():
                out, mro = self.in_flight
                self.in_flight = None
                results += self.s.update_from_output(out, mro)
                continue
            results += self.step()
        return results


def test_placeholders_let_the_next_step_run_before_the_token_arrives(cfg, req, specs):
    s = make_scheduler(cfg, specs, async_scheduling=True)
    s.add_request(req("a", list(range(20)), hashed=False, max_tokens=3))
    r = s.requests["a"]
    p = Pipeline(s, lambda rid, i: 40 + i)

    assert p.step() == []  # step 1: the prompt; it samples
    assert p.scheduled[-1] == {"a": 20} and r.num_output_placeholders == 1 and r.num_tokens == 20
    (res,) = p.step()  # step 2 scheduled on the placeholder, then step 1 lands
    assert p.scheduled[-1] == {"a": 1} and res.new_token_ids == [40]
    assert r.num_computed_tokens == 21 and r.num_tokens == 21 and r.num_output_placeholders == 1
    (res,) = p.step()  # step 3 (its 3rd token), then step 2 lands
    assert p.scheduled[-1] == {"a": 1} and res.new_token_ids == [41]
    (res,) = p.step()  # the token in flight is the 3rd: nothing scheduled
    assert p.scheduled[-1] == {} and res.new_token_ids == [42] and res.finish_reason == "length"
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.output_token_ids == [40, 41, 42]
    assert p.drain() == [] and not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10


def test_token_in_flight_after_a_stop_is_dropped(cfg, req, specs):
    s = make_scheduler(cfg, specs, async_scheduling=True, eos_token_id=2)
    s.add_request(req("a", [1, 1, 1], hashed=False, max_tokens=10))
    p = Pipeline(s, lambda rid, i: 2 if i == 1 else 9)  # the 2nd token is EOS
    results = p.drain()
    assert [(x.new_token_ids, x.finish_reason) for x in results] == [([9], None), ([2], "stop")]
    # The step after the EOS was already scheduled (3 of them); its token never shows up.
    assert p.scheduled[:3] == [{"a": 3}, {"a": 1}, {"a": 1}]
    assert s.requests == {} and s.kv_cache_manager.block_pool.get_num_free_blocks() == 10


def test_preemption_drops_the_token_in_flight_and_recomputes(cfg, req, specs):
    # 4 usable blocks of 16: "a" (40 tokens) and "b" (20) cannot both grow to their ends.
    s = make_scheduler(cfg, specs, num_blocks=5, async_scheduling=True)
    s.add_request(req("a", list(range(30)), hashed=False, max_tokens=12))
    s.add_request(req("b", list(range(100, 116)), hashed=False, max_tokens=12))
    p = Pipeline(s, lambda rid, i: 200 + i)
    results = p.drain(200)
    assert s.num_preemptions > 0
    tokens = {}
    for x in results:
        tokens.setdefault(x.request_id, []).extend(x.new_token_ids)
    # Each request's tokens are exactly its 12, in order: none lost, none duplicated.
    assert tokens == {"a": [200 + i for i in range(12)], "b": [200 + i for i in range(12)]}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_preempted_request_has_no_placeholder(cfg, req, specs):
    s = make_scheduler(cfg, specs, num_blocks=6, async_scheduling=True)
    s.add_request(req("a", list(range(16)), hashed=False, max_tokens=40))
    s.add_request(req("b", list(range(100, 116)), hashed=False, max_tokens=40))
    p = Pipeline(s)
    for _ in range(40):
        p.step()
        for r in list(s.running) + list(s.waiting):
            if r.status == RequestStatus.PREEMPTED:
                assert r.num_output_placeholders == 0 and r.num_computed_tokens == 0
            assert 0 <= r.num_output_placeholders <= 2
            assert r.num_computed_tokens <= r.num_tokens + max(r.num_output_placeholders - 1, 0)
        if s.num_preemptions:
            break
    assert s.num_preemptions > 0


def test_async_scheduling_config():
    with pytest.raises(TypeError, match="async_scheduling must be a bool, got 'yes'"):
        SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, async_scheduling="yes"
        )
    with pytest.raises(ValueError, match="speculative tokens"):
        SchedulerConfig(
            max_num_seqs=1,
            max_num_batched_tokens=8,
            max_model_len=8,
            async_scheduling=True,
            num_lookahead_tokens=2,
        )
    with pytest.raises(ValueError, match="AsyncScheduler"):
        Scheduler(
            make_config(3, full_spec()),
            max_num_seqs=1,
            max_num_batched_tokens=8,
            max_model_len=8,
            async_scheduling=True,
        )
    assert AsyncScheduler(
        make_config(3, full_spec()),
        max_num_seqs=1,
        max_num_batched_tokens=8,
        max_model_len=8,
        async_scheduling=True,
    ).async_scheduling
