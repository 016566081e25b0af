"""Scheduler scenarios, narrated step by step with exact block ids."""

import pytest

from jaxkv.core import (
    BlockStored,
    ModelRunnerOutput,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)
from jaxkv.core.async_scheduler import AsyncScheduler
from jaxkv.kv_cache import FullAttentionSpec


def make_scheduler(cfg, specs, num_blocks=11, block_size=16, **kwargs):
    settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    settings.update(kwargs)
    cls = AsyncScheduler if settings.get("async_scheduling") else Scheduler
    return cls(cfg(num_blocks, specs[0](block_size)), **settings)


def free_ids(scheduler):
    return [
        b.block_id
        for b in scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
    ]


def test_basic_prefill_decode_finish(cfg, req, specs, step):
    s = make_scheduler(cfg, specs)
    s.add_request(req("a", list(range(20)), hashed=False, max_tokens=2))
    s.add_request(req("b", list(range(100, 110)), hashed=False, max_tokens=3))
    assert s.get_num_unfinished_requests() == 2 and len(s.requests["a"].block_hashes) == 1

    # Step 1: both prompts in one batch (no prefill phase).
    out, results = step(s)
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ("a", ([1, 2],), 0),
        ("b", ([3],), 0),
    ]
    assert out.num_scheduled_tokens == {"a": 20, "b": 10} and out.total_num_scheduled_tokens == 30
    assert out.new_block_ids_to_zero == [1, 2, 3] and out.num_common_prefix_blocks == [0]
    assert [(r.request_id, r.new_token_ids, r.finish_reason) for r in results] == [
        ("a", [7], None),
        ("b", [7], None),
    ]

    # Step 2: both decode one token; no new blocks.
    out, results = step(s)
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a", "b"] and cached.resumed_from_preemption == [False, False]
    assert cached.new_token_ids == [[7], [7]] and cached.new_block_ids == [None, None]
    assert cached.num_computed_tokens == [20, 10] and out.new_block_ids_to_zero == []
    assert [(r.request_id, r.finish_reason) for r in results] == [("a", "length"), ("b", None)]

    # Step 3: "a" is reported finished to the worker; "b" reaches max_tokens.
    out, results = step(s)
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    assert results[0].finish_reason == "length" and results[0].new_token_ids == [7]
    out, results = step(s)
    assert out.finished_req_ids == {"b"} and out.total_num_scheduled_tokens == 0 and results == []
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10  # nothing leaks


def test_prefix_hit_is_reported(cfg, req, specs, step):
    s = make_scheduler(cfg, specs)
    s.add_request(req("a", list(range(40)), hashed=False, max_tokens=1))
    step(s)
    s.add_request(req("b", list(range(32)) + [99], hashed=False, max_tokens=1))
    out, results = step(s)
    assert out.finished_req_ids == {"a"}
    (new,) = out.scheduled_new_reqs
    # Blocks 1 and 2 hold tokens 0..31 of "a" (freed but still cached); block 3 is
    # evicted first, so "b" gets the next free block.
    assert new.num_computed_tokens == 32 and new.block_ids == ([1, 2, 4],)
    assert out.num_scheduled_tokens == {"b": 1} and out.new_block_ids_to_zero == [4]
    assert results[0].num_cached_tokens == 32
    stats = s.make_stats()
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / (40 + 33))


def test_prompt_logprobs_request_gets_no_hit(cfg, req, specs, step):
    s = make_scheduler(cfg, specs)
    s.add_request(req("a", list(range(40)), hashed=False, max_tokens=1))
    step(s)
    s.add_request(req("b", list(range(40)), hashed=False, max_tokens=1, prompt_logprobs=0))
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens == {
        "b": 40
    }


def test_chunked_prefill_under_a_small_budget(cfg, req, specs, step):
    s = make_scheduler(cfg, specs, max_num_batched_tokens=16)
    s.add_request(req("d", [1, 2, 3, 4], hashed=False, max_tokens=10))
    s.add_request(req("p", list(range(40)), hashed=False, max_tokens=10))
    progress = []
    for _ in range(3):
        out, results = step(s)
        progress.append(
            (
                out.num_scheduled_tokens,
                s.requests["p"].num_computed_tokens,
                [r.request_id for r in results],
            )
        )
    # Running requests go first; the long prompt takes what is left of the budget.
    assert progress == [
        ({"d": 4, "p": 12}, 12, ["d"]),  # "p" is a partial chunk: no token, no output
        ({"d": 1, "p": 15}, 27, ["d"]),
        ({"d": 1, "p": 13}, 40, ["d", "p"]),
    ]


def test_long_prefill_threshold(cfg, req, specs, step):
    s = make_scheduler(cfg, specs, long_prefill_token_threshold=8)
    s.add_request(req("p", list(range(20)), hashed=False))
    assert [step(s)[0].num_scheduled_tokens["p"] for _ in range(4)] == [8, 8, 4, 1]


def test_preemption_and_resume_hits_own_prefix(cfg, req, specs, step):
    # Block size 4, 6 usable blocks, two requests of 8 prompt tokens.
    s = make_scheduler(cfg, specs, num_blocks=7, block_size=4)
    s.add_request(req("a", list(range(8)), 4, hashed=False, max_tokens=7))
    s.add_request(req("b", list(range(50, 58)), 4, hashed=False, max_tokens=12))
    out, _ = step(s)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [([1, 2],), ([3, 4],)]
    out, _ = step(s)  # the 9th token needs a third block each
    assert out.scheduled_cached_reqs.new_block_ids == [([5],), ([6],)]
    for _ in range(3):
        step(s)  # positions 9..11 fit in the third blocks
    assert free_ids(s) == []

    # Step 6: "a" needs a 4th block, none is free: the last running request ("b") is
    # preempted (blocks freed last first: 6, 4, 3) and "a" takes block 6.
    out, _ = step(s)
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [([6],)]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_tokens == 13
    assert free_ids(s) == [4, 3]

    # Step 7: "b" would need its 2 cached blocks + 2 new, only 2 are free: it waits.
    # "a" reaches max_tokens and frees its blocks (last first).
    out, results = step(s)
    assert out.num_scheduled_tokens == {"a": 1} and results[0].finish_reason == "length"
    assert free_ids(s) == [4, 3, 6, 5, 2, 1]

    # Step 8: "b" resumes; its own prompt blocks 3 and 4 are still cached (8 tokens hit;
    # its third block was reused by "a") and the worker gets the full replacement block
    # list and all its tokens.
    out = s.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_from_preemption == [True]
    assert cached.new_block_ids == [([3, 4, 6, 5],)] and cached.num_computed_tokens == [8]
    assert out.num_scheduled_tokens == {"b": 5} and out.new_block_ids_to_zero == [6, 5]
    assert cached.all_token_ids["b"] == b.all_token_ids and cached.new_token_ids == [
        b.all_token_ids[8:13]
    ]
    assert s.make_stats().num_preemptions == 1


def test_priority_preemption_gives_back_budget(cfg, req, specs, step):
    s = make_scheduler(cfg, specs, num_blocks=8, block_size=4, policy="priority")
    s.add_request(
        req("lo", list(range(8)), 4, hashed=False, max_tokens=20, priority=5, arrival_time=1.0)
    )
    step(s)
    s.add_request(
        req("hi", list(range(50, 58)), 4, hashed=False, max_tokens=20, priority=0, arrival_time=2.0)
    )
    for _ in range(5):
        out, _ = step(s)  # steps 2..6: "lo" ends with blocks [1, 2, 3, 7], "hi" with [4, 5, 6]
    assert s.kv_cache_manager.get_block_ids("lo") == ([1, 2, 3, 7],)
    assert s.kv_cache_manager.get_block_ids("hi") == ([4, 5, 6],)
    # Step 7: "lo" is scheduled first (no new block); then "hi" needs one and the
    # lowest-priority request, "lo", is preempted although already scheduled: its
    # token is taken back from the batch.
    out, _ = step(s)
    assert out.preempted_req_ids == {"lo"} and out.num_scheduled_tokens == {"hi": 1}
    assert out.total_num_scheduled_tokens == 1 and out.scheduled_cached_reqs.req_ids == ["hi"]
    assert out.scheduled_cached_reqs.new_block_ids == [([7],)]
    assert [r.request_id for r in s.running] == ["hi"] and s.requests[
        "lo"
    ].status is RequestStatus.PREEMPTED


def test_stop_conditions(cfg, req, specs, step):
    s = make_scheduler(cfg, specs, num_blocks=20, max_model_len=12, eos_token_id=2)
    s.add_request(req("eos", [1, 1], hashed=False))
    s.add_request(req("ignore", [1, 1], hashed=False, ignore_eos=True, max_tokens=3))
    s.add_request(req("stop_id", [1, 1], hashed=False, stop_token_ids=[5]))
    s.add_request(req("min", [1, 1], hashed=False, min_tokens=2))
    s.add_request(req("len", list(range(10)), hashed=False, max_tokens=None, eos_token_id=2))
    tokens = {"eos": 2, "ignore": 2, "stop_id": 5, "min": 2, "len": 9}
    finished = {}
    while s.has_unfinished_requests():
        for r in step(s, lambda rid, i: tokens[rid])[1]:
            if r.finished:
                finished[r.request_id] = (r.finish_reason, r.stop_reason)
    assert finished == {
        "eos": ("stop", None),
        "ignore": ("length", None),
        "stop_id": ("stop", 5),
        "min": ("stop", None),
        "len": ("length", None),  # 10 + 2 tokens = max_model_len
    }


def test_spec_decode_rollback(cfg, req, specs):
    s = make_scheduler(cfg, specs, num_blocks=20, block_size=4)
    s.add_request(req("s", list(range(8)), 4, hashed=False, max_tokens=10))
    out = s.schedule()
    s.update_from_output(
        out, ModelRunnerOutput(["s"], {"s": 0}, [[7]], spec_token_ids=[[11, 12, 13]])
    )
    r = s.requests["s"]
    assert r.num_tokens_with_spec == 12
    out = s.schedule()
    assert out.num_scheduled_tokens == {"s": 4} and out.scheduled_spec_decode_tokens == {
        "s": [11, 12, 13]
    }
    assert out.scheduled_cached_reqs.new_token_ids == [[7]]  # drafts are listed separately
    held = s.kv_cache_manager.single_type_managers[0].req_to_blocks["s"]
    assert [b.block_hash is not None for b in held] == [True, True, False]  # drafts never cached
    # One draft accepted plus the bonus token: two drafts rolled back.
    (res,) = s.update_from_output(out, ModelRunnerOutput(["s"], {"s": 0}, [[11, 20]]))
    assert res.new_token_ids == [11, 20] and r.num_computed_tokens == 10 and r.num_tokens == 11
    assert s.schedule().num_scheduled_tokens == {"s": 1}


def test_abort(cfg, req, specs, step):
    s = make_scheduler(cfg, specs, max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, list(range(20)), hashed=False))
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert s.finish_requests(["b", "c", "nope", "b"]) == ["b", "c"]  # unknown ids are ignored
    assert s.finish_requests("nope") == []
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 0
    assert s.schedule().finished_req_ids == {"b", "c"}
    (res,) = s.abort_requests("a")
    assert res.finish_reason == "abort" and res.num_cached_tokens == 0
    assert (
        not s.has_unfinished_requests()
        and s.kv_cache_manager.block_pool.get_num_free_blocks() == 10
    )
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_bad_input_is_rejected_without_state_change(cfg, req, specs):
    s = make_scheduler(cfg, specs, num_blocks=5, max_model_len=100)  # 4 usable blocks = 64 tokens
    with pytest.raises(
        ValueError, match="prompt of 100 tokens leaves no room for output under max_model_len=100"
    ):
        s.add_request(req("long", list(range(100)), hashed=False))
    with pytest.raises(
        ValueError, match="may grow to 70 tokens, which needs 5 KV blocks, but the pool has only 4"
    ):
        s.add_request(req("big", list(range(60)), hashed=False, max_tokens=10))
    assert s.requests == {} and len(s.waiting) == 0
    s.add_request(req("ok", [1, 2], hashed=False))
    with pytest.raises(ValueError, match="duplicate request id 'ok'"):
        s.add_request(req("ok", [3], hashed=False))
    with pytest.raises(ValueError, match="hashes blocks of 4 tokens, the cache uses 16"):
        s.add_request(req("bs", [3], 4))
    assert list(s.requests) == ["ok"] and len(s.waiting) == 1
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        req("zero", [1], max_tokens=0)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 12"):
        FullAttentionSpec(block_size=12, num_kv_heads=1, head_size=8, dtype="float32")
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        FullAttentionSpec(block_size=0, num_kv_heads=1, head_size=8, dtype="float32")


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8)
    with pytest.raises(ValueError, match=r"without chunked prefill max_num_batched_tokens \(8\)"):
        SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False
        )
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, policy="lifo")
    with pytest.raises(ValueError, match="hash_algo"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, hash_algo="md5")
    with pytest.raises(TypeError, match="not both"):
        Scheduler(
            None,
            SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8),
            max_num_seqs=2,
        )


def test_no_chunked_prefill_skips_requests_that_do_not_fit(cfg, req, specs, step):
    s = make_scheduler(
        cfg, specs, max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    s.add_request(req("a", list(range(20)), hashed=False))
    s.add_request(req("b", list(range(100, 120)), hashed=False))
    s.add_request(req("c", [5] * 8, hashed=False))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20, "c": 8}  # "b" does not fit whole, "c" does
    assert [r.request_id for r in s.waiting] == ["b"]


def test_kv_events_are_drained_per_step(cfg, req, specs, step):
    s = make_scheduler(cfg, specs, enable_kv_cache_events=True)
    s.add_request(req("a", list(range(20)), hashed=False))
    step(s)
    (batch,) = s.take_kv_events()
    assert batch.events == (
        BlockStored((s.requests["a"].block_hashes[0],), None, tuple(range(16)), 16),
    )
    assert s.take_kv_events() == []
