"""Prefill/decode disaggregation device to device (JaxTransferConnector over
jax.experimental.transfer), P and D in separate processes on loopback.

D's greedy tokens equal a single engine's, D computes only the last prompt token of each
request, P frees every block once D has pulled, and nothing leaks on either side. Faults
(P killed before the pull, a pull that never completes, D aborting while loading, P's hold
timeout) make D recompute: same tokens, bounded waits, no leaks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from jaxkv import LLM, SamplingParams
from tests.distributed.helpers import ENGINE, finish, prompts, start_producer
from tests.engine.helpers import assert_no_block_leaks

#: P keeps each finished request's blocks until D has pulled them, and D only starts once P's
#: offline batch is done: P's pool must hold the whole batch.
PRODUCER = dict(ENGINE, kv_cache_memory_bytes=64 << 20)


def transfer(role, **extra):
    if role == "kv_producer":  # an offline batch: every copy is offered before D pulls any
        extra.setdefault("max_offered_bytes", PRODUCER["kv_cache_memory_bytes"])
    return {
        "kv_connector": "JaxTransferConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def generate(llm, ps, params=None, max_tokens=8):
    params = params or [None] * len(ps)
    sps = [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p else None,
        )
        for p in params
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def workload():
    """64 prompts of 2..150 tokens, and a single (plain) engine's greedy tokens for them."""
    import numpy as np

    rng = np.random.default_rng(5)
    ps = prompts(64, lengths=[int(n) for n in rng.integers(2, 150, size=64)])
    plain = LLM("tiny-llama", **ENGINE)
    want, _ = generate(plain, ps)
    plain.shutdown()
    return ps, want


@pytest.fixture(scope="module")
def decode():
    llm = LLM(
        "tiny-llama", kv_transfer_config=transfer("kv_consumer", load_timeout_s=15.0), **ENGINE
    )
    yield llm
    llm.shutdown()


@pytest.fixture(autouse=True)
def _cold_decode_cache(decode):
    """Each test starts with nothing in D's prefix cache (the tests share prompts)."""
    assert decode.llm_engine.reset_prefix_cache()


def worker_connector(llm):
    return llm.llm_engine.engine_core.model_executor.driver_worker.worker.kv_connector


def stats(llm):
    s = llm.llm_engine.engine_core.scheduler
    return s.num_external_computed_tokens, s.num_failed_kv_loads


def test_pd_tokens_equal_and_d_computes_only_last_token(workload, decode, tmp_path):
    ps, want = workload
    p_proc, params, p_out = start_producer(
        tmp_path, "p", ps, dict(PRODUCER, kv_transfer_config=transfer("kv_producer"))
    )
    assert all(p and p["do_remote_prefill"] for p in params)
    ext0, failed0 = stats(decode)
    got, cached = generate(decode, ps, params)
    assert got == want
    assert cached == [len(p) - 1 for p in ps]  # D computed the last token only
    ext, failed = stats(decode)
    assert ext - ext0 == sum(len(p) - 1 for p in ps) and failed == failed0
    assert_no_block_leaks(decode)
    p_res = finish(p_proc, p_out, tmp_path / "p.log")
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]  # P freed every block


@pytest.mark.slow
def test_pd_with_prefix_hits_on_both_sides(workload, decode, tmp_path):
    """Prompts extending earlier ones: P computes them from its prefix cache, D pulls only
    the blocks beyond its own prefix hit (its loaded blocks were cached like computed ones)."""
    ps, want = workload[0][:4], workload[1][:4]
    p_proc, params, p_out = start_producer(
        tmp_path, "p", ps, dict(PRODUCER, kv_transfer_config=transfer("kv_producer"))
    )
    assert generate(decode, ps, params)[0] == want
    finish(p_proc, p_out, tmp_path / "p.log")
    longer = [p + [int(t) for t in range(7, 7 + 40)] for p in ps]
    plain = LLM("tiny-llama", **ENGINE)
    want2, _ = generate(plain, longer)
    plain.shutdown()
    p_proc, params, p_out = start_producer(
        tmp_path, "p2", longer, dict(PRODUCER, kv_transfer_config=transfer("kv_producer")), warm=ps
    )
    p_first = __import__("json").load(open(p_out + ".partial"))
    assert all(
        c >= len(p) // 16 * 16 - 16 for c, p in zip(p_first["cached"], ps)
    )  # P's own prefix hits
    ext0, _ = stats(decode)
    got, cached = generate(decode, longer, params)
    assert got == want2 and cached == [len(p) - 1 for p in longer]
    ext, failed = stats(decode)
    local = sum(len(p) // 16 * 16 for p in ps)  # D's own hits: the first batch's full blocks
    assert ext - ext0 == sum(len(p) - 1 for p in longer) - local and failed == 0
    assert_no_block_leaks(decode)
    p_res = finish(p_proc, p_out, tmp_path / "p2.log")
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]


def test_offered_copies_are_bounded(workload, decode, tmp_path):
    """P's offered copies (device memory outside its KV budget) stay under max_offered_bytes:
    past it a request is not offered and finishes without parameters, and D computes its
    prompt (the same tokens); the rest are pulled as usual; nothing leaks."""
    ps, want = workload[0][:12], workload[1][:12]
    block_bytes = (
        8 * 2 * 2 * 64 * 16 * 4
    )  # tiny-llama: 8 layers x K,V x 2 KV heads x 64 x 16 tokens x f32
    limit = 8 * block_bytes
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer", max_offered_bytes=limit)),
    )
    offered = [p is not None for p in params]
    assert any(offered) and not all(offered)
    ext0, failed0 = stats(decode)
    got, cached = generate(decode, ps, params)
    assert got == want
    assert [c == len(p) - 1 for c, p in zip(cached, ps)] == offered  # pulled ones computed 1 token
    assert stats(decode)[1] == failed0
    assert_no_block_leaks(decode)
    p_res = finish(p_proc, p_out, tmp_path / "p.log")
    assert p_res["refused_offers"] == offered.count(False)
    assert p_res["kv_stats"]["bytes_offered"] <= limit + max(len(p) for p in ps) // 16 * block_bytes
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]


def test_kv_budget_leaves_room_for_offered_copies():
    from jaxkv.distributed.kv_transfer import KVTransferConfig
    from jaxkv.distributed.kv_transfer.transfer_connector import kv_bytes_beside_offers

    def cfg(role, **extra):
        return KVTransferConfig.from_any(transfer(role, **extra))

    assert kv_bytes_beside_offers(1000, cfg("kv_producer", max_offered_bytes=300)) == 700
    p = cfg("kv_producer")
    del p.kv_connector_extra_config["max_offered_bytes"]
    assert kv_bytes_beside_offers(1000, p) == 800  # the cache and a quarter of it
    assert kv_bytes_beside_offers(1000, cfg("kv_consumer")) == 1000
    assert kv_bytes_beside_offers(1000, None) == 1000
    with pytest.raises(ValueError, match="max_offered_bytes"):
        LLM(
            "tiny-llama", kv_transfer_config=transfer("kv_producer", max_offered_bytes=-1), **ENGINE
        )


def test_malformed_params_compute_locally(workload, decode):
    """Parameters a client made up or mangled: logged, the prompt is computed here."""
    ps, want = workload[0][:3], workload[1][:3]
    bad = [
        {"do_remote_prefill": True},
        {
            "do_remote_prefill": True,
            "remote_uuid": "7",
            "remote_agents": [],
            "remote_positions": [],
            "remote_layout": {},
        },
        {
            "do_remote_prefill": True,
            "remote_uuid": 7,
            "remote_agents": [{"transfer": "x", "notify": "y"}],
            "remote_positions": [[0]],
            "remote_layout": {},
        },
    ]
    ext0, failed0 = stats(decode)
    got, cached = generate(decode, ps, bad)
    assert got == want and stats(decode) == (ext0, failed0) and cached == [0, 0, 0]
    assert_no_block_leaks(decode)


@pytest.mark.slow
def test_layout_mismatch_computes_locally(workload, decode, tmp_path):
    """Parameters from a P whose KV layout differs (another head split, here a faked one):
    D never pulls, it computes the prompt itself."""
    ps, want = workload[0][:4], workload[1][:4]
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer", hold_timeout_s=2.0)),
        drain_s=30,
    )
    foreign = [dict(p, remote_layout=dict(p["remote_layout"], tp=2)) for p in params]
    ext0, failed0 = stats(decode)
    got, cached = generate(decode, ps, foreign)
    assert got == want and stats(decode) == (ext0, failed0) and cached == [0] * len(ps)
    assert_no_block_leaks(decode)
    p_res = finish(p_proc, p_out, tmp_path / "p.log")  # P's offers expire: it frees everything
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]


def test_p_killed_before_pull_recomputes(workload, decode, tmp_path):
    ps, want = workload[0][:8], workload[1][:8]
    p_proc, params, _ = start_producer(
        tmp_path, "p", ps, dict(PRODUCER, kv_transfer_config=transfer("kv_producer"))
    )
    os.kill(p_proc.pid, signal.SIGKILL)
    p_proc.wait(timeout=30)
    ext0, failed0 = stats(decode)
    t0 = time.monotonic()
    got, cached = generate(decode, ps, params)
    assert got == want and time.monotonic() - t0 < 60
    ext, failed = stats(decode)
    assert failed - failed0 == len(ps) and ext == ext0 and cached == [0] * len(ps)
    assert_no_block_leaks(decode)


@pytest.mark.slow
def test_never_completing_pull_and_hold_timeout(workload, decode, tmp_path):
    """Half the requests name a uuid P never registered (D's deadline fails them); P's offers
    for those expire after its hold timeout, freeing its blocks; the other half load."""
    ps, want = workload[0][:8], workload[1][:8]
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer", hold_timeout_s=4.0)),
        drain_s=60,
    )
    bad = [dict(p, remote_uuid=p["remote_uuid"] ^ 1) if i % 2 else p for i, p in enumerate(params)]
    ext0, failed0 = stats(decode)
    worker_connector(decode).load_timeout_s = 2.0  # D's deadline for the pulls that never complete
    try:
        t0 = time.monotonic()
        got, cached = generate(decode, ps, bad)
        assert time.monotonic() - t0 < 30
    finally:
        worker_connector(decode).load_timeout_s = 15.0
    assert got == want
    ext, failed = stats(decode)
    assert failed - failed0 == len(ps) // 2
    assert cached == [len(p) - 1 if i % 2 == 0 else 0 for i, p in enumerate(ps)]
    assert_no_block_leaks(decode)
    p_res = finish(p_proc, p_out, tmp_path / "p.log")
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]


@pytest.mark.slow
def test_pull_after_hold_timeout_recomputes(workload, decode, tmp_path):
    ps, want = workload[0][:4], workload[1][:4]
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer", hold_timeout_s=1.0)),
        drain_s=30,
    )
    p_res = finish(p_proc, p_out, tmp_path / "p.log")  # P's offers expired: it freed everything
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]
    ext0, failed0 = stats(decode)
    got, _ = generate(decode, ps, params)  # P is gone by now, too
    assert got == want and stats(decode)[1] - failed0 == len(ps)
    assert_no_block_leaks(decode)


def test_abort_while_loading(workload, decode, tmp_path):
    """D aborts requests whose pulls are in flight (the uuid is never registered): blocks
    return at once, nothing is written later, other requests carry on."""
    ps, want = workload[0][:4], workload[1][:4]
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer", hold_timeout_s=60.0)),
        drain_s=90,
    )
    engine = decode.llm_engine
    stuck = [dict(p, remote_uuid=p["remote_uuid"] ^ 1) for p in params]
    for i, (p, kv) in enumerate(zip(ps, stuck)):
        engine.add_request(
            f"stuck-{i}",
            {"prompt_token_ids": p},
            SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_transfer_params": kv}),
        )
    for _ in range(5):
        engine.step()
    sched = engine.engine_core.scheduler
    assert sched.num_waiting_for_remote_kvs() == len(ps)
    engine.abort_request([f"stuck-{i}" for i in range(len(ps))])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_block_leaks(decode)
    got, cached = generate(decode, ps, params)  # the real ones still load and decode
    assert got == want and cached == [len(p) - 1 for p in ps]
    assert_no_block_leaks(decode)
    finish(p_proc, p_out, tmp_path / "p.log")
