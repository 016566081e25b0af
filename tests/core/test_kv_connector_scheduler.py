"""The scheduler with a KV connector (vLLM V1's connector flow), narrated with exact block ids:
asynchronous loads in WAITING_FOR_REMOTE_KVS, failed loads recomputing, delayed frees for
sends, aborts during a load, synchronous external tokens. A scripted fake connector stands in
for the worker side; no jax."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.core import RequestStatus, Scheduler
from jaxkv.core.async_scheduler import AsyncScheduler
from jaxkv.core.outputs import KVConnectorOutput
from jaxkv.distributed.kv_transfer import KVConnectorBase_V1, KVConnectorRole, KVTransferConfig
from tests.core.conftest import (
    fake_model_runner_output,
    full_spec,
    make_config,
    make_request,
    sw_spec,
)


class FakeConnector(KVConnectorBase_V1):
    """Offers ``external[req_id]`` tokens (async unless ``sync``); records calls; keeps the
    blocks of requests listed in ``send`` until told."""

    def __init__(self, external=None, *, sync=False, send=()):
        super().__init__(KVTransferConfig("fake"), KVConnectorRole.SCHEDULER)
        self.external = dict(external or {})
        self.sync = sync
        self.send = set(send)
        self.allocs, self.finished, self.metas, self.outputs = [], [], [], []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = self.external.get(request.request_id, 0) - num_computed_tokens
        return (n, not self.sync) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocs.append((request.request_id, blocks.get_block_ids(), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.metas.append(scheduler_output)
        return "meta"

    def update_connector_output(self, connector_output):
        self.outputs.append(connector_output)

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, block_ids))
        if request.request_id in self.send:
            return True, {"blocks": block_ids[0]}
        return False, None


def make(connector, num_blocks=11, *specs, **kwargs):
    settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    settings.update(kwargs)
    cls = AsyncScheduler if settings.get("async_scheduling") else Scheduler
    return cls(
        make_config(num_blocks, *(specs or (full_spec(),))), kv_connector=connector, **settings
    )


def run(s, out, kv=None):
    mro = fake_model_runner_output(s, out)
    mro.kv_connector_output = kv
    return s.update_from_output(out, mro)


def num_free(s):
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_async_load_waits_then_runs_only_the_last_token():
    c = FakeConnector({"a": 40})
    s = make(c)
    s.add_request(make_request("a", list(range(40)), max_tokens=2))
    out = s.schedule()
    # Nothing is computed while the load is in flight; its 3 blocks are held and not zeroed.
    assert out.total_num_scheduled_tokens == 0 and out.new_block_ids_to_zero == []
    assert out.kv_connector_metadata == "meta"
    assert c.allocs == [("a", ([1, 2, 3],), 40)]
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and num_free(s) == 7
    run(s, out, KVConnectorOutput())
    out = s.schedule()  # still loading: set aside, nothing scheduled
    assert (
        out.total_num_scheduled_tokens == 0
        and s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    )
    run(s, out, KVConnectorOutput(finished_recving={"a"}))
    # Loaded: 39 tokens computed (the last prompt token is recomputed, to sample), as a new request.
    out = s.schedule()
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ("a", ([1, 2, 3],), 39)
    ]
    assert out.num_scheduled_tokens == {"a": 1} and out.new_block_ids_to_zero == []
    assert s.num_external_computed_tokens == 39 and s.requests["a"].num_cached_tokens == 39
    results = run(s, out, KVConnectorOutput())
    assert results[0].new_token_ids == [7]
    # The loaded full blocks are now in the prefix cache: a second request hits them.
    s.add_request(make_request("b", list(range(40)), max_tokens=1))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32 and out.scheduled_new_reqs[
        0
    ].block_ids[0][:2] == [1, 2]


def test_failed_load_frees_blocks_and_recomputes_without_the_connector():
    c = FakeConnector({"a": 40})
    s = make(c)
    s.add_request(make_request("a", list(range(40)), max_tokens=1))
    run(s, s.schedule(), KVConnectorOutput())
    run(s, s.schedule(), KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={2}))
    out = s.schedule()
    # Recomputed from scratch: whole prompt, fresh blocks (zeroed this time), not asked again.
    assert (
        out.num_scheduled_tokens == {"a": 40} and out.scheduled_new_reqs[0].num_computed_tokens == 0
    )
    assert out.new_block_ids_to_zero == out.scheduled_new_reqs[0].block_ids[0]
    assert len(c.allocs) == 2 and c.allocs[1][2] == 0 and s.num_failed_kv_loads == 1
    assert run(s, out, KVConnectorOutput())[0].finish_reason == "length"
    assert num_free(s) == 10 and not s.requests


def test_abort_during_load_frees_everything():
    c = FakeConnector({"a": 40})
    s = make(c)
    s.add_request(make_request("a", list(range(40)), max_tokens=4))
    run(s, s.schedule(), KVConnectorOutput())
    assert num_free(s) == 7
    s.finish_requests("a")
    assert num_free(s) == 10 and not s.requests and c.finished[0][0] == "a"
    out = s.schedule()
    assert out.finished_req_ids == {"a"}  # the worker drops the load in flight
    run(s, out, KVConnectorOutput(finished_recving={"a"}))  # a late report changes nothing
    assert num_free(s) == 10 and not s.has_unfinished_requests()


def test_delayed_free_until_sent():
    c = FakeConnector(send={"a"})
    s = make(c)
    s.add_request(make_request("a", list(range(20)), max_tokens=1))
    results = run(s, s.schedule(), KVConnectorOutput())
    assert results[0].finish_reason == "length" and results[0].kv_transfer_params == {
        "blocks": [1, 2]
    }
    # Finished, but its blocks are kept for the send: the engine must keep polling.
    assert not s.has_unfinished_requests() and s.has_pending_kv_sends() and num_free(s) == 8
    run(s, s.schedule(), KVConnectorOutput())
    assert num_free(s) == 8
    run(s, s.schedule(), KVConnectorOutput(finished_sending={"a"}))
    assert not s.has_pending_kv_sends() and num_free(s) == 10 and not s.requests


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_send_reported_done_before_the_request_finishes(max_tokens):
    """A worker may report a send ended (its offer expired: P's hold timeout is shorter than
    the rest of the step, or than the decode that follows) in the same step's output that
    finishes the request, or earlier: the blocks are freed when it finishes, not kept for a
    report that already came."""
    c = FakeConnector(send={"a"})
    s = make(c)
    s.add_request(make_request("a", list(range(20)), max_tokens=max_tokens))
    kv = KVConnectorOutput(finished_sending={"a"})
    results = run(s, s.schedule(), kv)
    while not results or results[-1].finish_reason is None:
        results = run(s, s.schedule(), KVConnectorOutput())
    assert results[-1].finish_reason == "length"
    assert not s.has_pending_kv_sends() and num_free(s) == 10 and not s.requests
    assert not s._sent_early


def test_sync_external_tokens_are_computed_and_not_zeroed():
    c = FakeConnector({"a": 32}, sync=True)
    s = make(c)
    s.add_request(make_request("a", list(range(40)), max_tokens=1))
    out = s.schedule()
    # 32 loaded before the step, 8 computed; blocks 1, 2 hold loaded tokens: never zeroed.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32 and out.num_scheduled_tokens == {
        "a": 8
    }
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3],) and out.new_block_ids_to_zero == [3]
    assert s.num_external_computed_tokens == 32


def test_hybrid_groups_all_get_blocks_and_none_is_zeroed():
    c = FakeConnector({"a": 80})
    s = make(c, 30, full_spec(), sw_spec(sliding_window=32))
    s.add_request(make_request("a", list(range(80)), max_tokens=1))
    out = s.schedule()
    assert out.new_block_ids_to_zero == []
    ids = c.allocs[0][1]
    assert [len(g) for g in ids] == [5, 5] and not set(ids[0]) & set(ids[1])
    run(s, out, KVConnectorOutput(finished_recving={"a"}))
    out = s.schedule()
    assert (
        out.num_scheduled_tokens == {"a": 1} and out.scheduled_new_reqs[0].num_computed_tokens == 79
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 90), st.integers(0, 90), st.booleans(), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
    st.lists(st.sampled_from(["ok", "fail", "abort", "wait"]), min_size=40, max_size=40),
)
def test_no_block_leaks_whatever_the_loads_do(reqs, events):
    """Random loads that succeed, fail, are aborted or linger, with sends kept and released:
    every block returns once all requests end."""
    ext = {f"r{i}": e for i, (_, e, _, _) in enumerate(reqs)}
    c = FakeConnector(ext, send={f"r{i}" for i, (_, _, snd, _) in enumerate(reqs) if snd})
    s = make(c, 40, max_model_len=128)
    for i, (n, _, _, mt) in enumerate(reqs):
        s.add_request(make_request(f"r{i}", list(range(1000 * i, 1000 * i + n)), max_tokens=mt + 1))
    for ev in events:
        out = s.schedule()
        loading = sorted(
            r for r, q in s.requests.items() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        kv = KVConnectorOutput(finished_sending=set(s._sending))
        if loading and ev == "ok":
            kv.finished_recving = {loading[0]}
        elif loading and ev == "fail":
            kv.finished_recving = {loading[0]}
            kv.invalid_block_ids = set(s.kv_cache_manager.get_block_ids(loading[0])[0][-1:])
        elif loading and ev == "abort":
            s.finish_requests(loading[0])
        run(s, out, kv)
    for _ in range(200):  # drain: every load ends, every send is reported
        if not (s.has_unfinished_requests() or s.has_pending_kv_sends()):
            break
        out = s.schedule()
        loading = {
            r for r, q in s.requests.items() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        run(s, out, KVConnectorOutput(finished_recving=loading, finished_sending=set(s._sending)))
    assert not s.requests and num_free(s) == 39


def test_failed_sync_load_drops_its_token_and_recomputes_from_the_first_bad_block():
    c = FakeConnector({"a": 48}, sync=True)
    s = make(c)
    s.add_request(make_request("a", list(range(50)), max_tokens=2))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 2} and out.scheduled_new_reqs[0].block_ids == (
        [1, 2, 3, 4],
    )
    # Block 2 (tokens 16..31) failed: the token sampled over it is never returned.
    assert run(s, out, KVConnectorOutput(invalid_block_ids={2})) == []
    a = s.requests["a"]
    assert (
        a.status == RequestStatus.PREEMPTED
        and a.output_token_ids == []
        and s.num_failed_kv_loads == 1
    )
    out = s.schedule()
    # Told to the runner; block 1 (valid) is a prefix hit, the rest is recomputed; the
    # connector is not asked again.
    assert out.preempted_req_ids == {"a"} and out.scheduled_cached_reqs.resumed_from_preemption == [
        True
    ]
    assert out.scheduled_cached_reqs.num_computed_tokens == [16] and out.num_scheduled_tokens == {
        "a": 34
    }
    assert out.scheduled_cached_reqs.new_block_ids[0][0][0] == 1 and c.allocs[1][2] == 0
    assert run(s, out, KVConnectorOutput())[0].new_token_ids == [7]
    # A later request with the same prompt hits only what was recomputed, never block 2's old KV.
    s.add_request(make_request("b", list(range(50)), max_tokens=1))
    out = s.schedule()
    assert (
        out.scheduled_new_reqs[0].block_ids[0][:3] == s.kv_cache_manager.get_block_ids("a")[0][:3]
    )
    assert 2 not in s.kv_cache_manager.get_block_ids("a")[0]


def test_failed_sync_load_also_recomputes_a_request_that_hit_its_blocks():
    c = FakeConnector({"a": 32}, sync=True)
    s = make(c)
    s.add_request(make_request("a", list(range(40)), max_tokens=1))
    s.add_request(
        make_request("b", list(range(40)), max_tokens=1)
    )  # same schedule: hits a's blocks
    out = s.schedule()
    assert (
        out.scheduled_new_reqs[1].block_ids[0][:2] == [1, 2]
        and out.scheduled_new_reqs[1].num_computed_tokens == 32
    )
    assert run(s, out, KVConnectorOutput(invalid_block_ids={1})) == []
    out = s.schedule()
    assert out.preempted_req_ids == {"a", "b"}
    # a recomputes from 0 (its first block was bad); b hits a's new blocks, written this step.
    a_ids, b_ids = (ids[0] for ids in out.scheduled_cached_reqs.new_block_ids)
    assert out.scheduled_cached_reqs.num_computed_tokens == [0, 32] and b_ids[:2] == a_ids[:2]
    assert not {1, 2} & set(a_ids + b_ids)
    done = run(s, out, KVConnectorOutput())
    assert sorted((x.request_id, x.finish_reason) for x in done) == [
        ("a", "length"),
        ("b", "length"),
    ]
    assert num_free(s) == 10 and not s.requests


def test_failed_sync_load_with_async_scheduling_waits_for_the_step_in_flight():
    from tests.core.test_async_scheduling import Pipeline

    c = FakeConnector({"a": 32}, sync=True)
    s = make(c, async_scheduling=True)
    s.add_request(make_request("a", list(range(40)), max_tokens=3))
    p = Pipeline(s, lambda rid, i: 100 + i)
    bad = {"kv": KVConnectorOutput(invalid_block_ids={2})}
    real = s.update_from_output

    def update(out, mro):  # the first step's report names block 2 invalid
        mro.kv_connector_output = bad.pop("kv", KVConnectorOutput())
        return real(out, mro)

    s.update_from_output = update
    assert p.step() == []  # step 1: loads 32, computes 8, samples
    assert p.step() == []  # step 2 on the placeholder; step 1 lands: failed
    assert s.requests["a"].status == RequestStatus.PREEMPTED
    assert p.step() == []  # step 3: not re-admitted (step 2 in flight); step 2 dropped
    assert p.scheduled[-1] == {} and s.requests["a"].status == RequestStatus.PREEMPTED
    results = p.drain()
    assert p.scheduled[3] == {"a": 40 - 16}  # recomputed from block 2 (block 1 still a hit)
    assert [t for x in results for t in x.new_token_ids] == [100, 101, 102]
    assert num_free(s) == 10 and not s.requests and s.num_failed_kv_loads == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 90), st.integers(0, 90), st.integers(0, 3)), min_size=1, max_size=8
    ),
    st.lists(st.integers(0, 3), min_size=40, max_size=40),
    st.booleans(),
)
def test_failed_sync_loads_never_return_a_token_and_never_leak(reqs, fails, async_scheduling):
    """Synchronous loads whose blocks are reported invalid at random (also with async
    scheduling): a request never gets a token from a step whose load failed for it, the
    invariants hold after every step, and every block returns."""
    from jaxkv.core.consistency import scheduler_problems
    from tests.core.test_async_scheduling import sampled_rows

    c = FakeConnector({f"r{i}": e for i, (_, e, _) in enumerate(reqs)}, sync=True)
    s = make(c, 40, max_model_len=128, async_scheduling=async_scheduling)
    for i, (n, _, mt) in enumerate(reqs):  # pairs of requests share prompts (prefix hits)
        s.add_request(
            make_request(
                f"r{i}", list(range(1000 * (i // 2), 1000 * (i // 2) + n)), max_tokens=mt + 1
            )
        )
    pending = []  # steps scheduled, not yet updated (one in flight with async scheduling)
    for k in range(len(fails) + 200):
        if k >= len(fails) and not s.has_unfinished_requests() and not pending:
            break
        before = dict(s._sync_loads)
        out = s.schedule()
        loads = {
            r: t for r, t in s._sync_loads.items() if before.get(r) is not t
        }  # this step's loads
        mro = (
            sampled_rows(s, out, lambda r, i: 7)
            if async_scheduling
            else fake_model_runner_output(s, out)
        )
        pending.append((out, loads, mro))
        if async_scheduling and len(pending) < 2 and s.has_unfinished_requests():
            continue
        out, loads, mro = pending.pop(0)
        bad = set()
        if loads and k < len(fails) and fails[k]:
            victim = sorted(loads)[fails[k] % len(loads)]
            bad = {b for ids in loads[victim] for b in ids if b}
        mro.kv_connector_output = KVConnectorOutput(invalid_block_ids=set(list(sorted(bad))[:1]))
        failed_now = {
            r
            for r, t in loads.items()
            if mro.kv_connector_output.invalid_block_ids & {b for ids in t for b in ids}
        }
        results = s.update_from_output(out, mro)
        assert not failed_now & {x.request_id for x in results if x.new_token_ids}
        assert scheduler_problems(s) == []
    assert not s.requests and num_free(s) == 39


def test_failed_step_recovery_tells_the_connector_and_keeps_sends():
    """A step fails while "a" loads asynchronously, "b" runs and "c" (finished) keeps its
    blocks for a send: the invariants hold with those states (no hard reset); "b", whose
    step failed, is aborted and the connector hears of it (request_finished) so it forgets
    what it kept; "a" and the send carry on."""
    from jaxkv.core.consistency import scheduler_problems
    from jaxkv.core.recovery import abort_failed_steps

    c = FakeConnector({"a": 40}, send={"c"})
    s = make(c)
    s.add_request(make_request("c", list(range(500, 520)), max_tokens=1))
    run(s, s.schedule(), KVConnectorOutput())
    assert s.has_pending_kv_sends() and c.finished == [("c", ([1, 2],))]
    s.add_request(make_request("a", list(range(40)), max_tokens=1))
    s.add_request(make_request("b", list(range(100, 120)), max_tokens=3))
    s.schedule()  # "a" starts loading, "b" computes: this step fails
    assert scheduler_problems(s) == []
    assert abort_failed_steps(s) == ["b"]
    assert s.num_hard_resets == 0 and scheduler_problems(s) == []
    assert [f[0] for f in c.finished] == ["c", "b"] and s.has_pending_kv_sends()
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run(s, s.schedule(), KVConnectorOutput(finished_recving={"a"}, finished_sending={"c"}))
    run(s, s.schedule(), KVConnectorOutput())
    assert not s.requests and num_free(s) == 10
