"""Prefill / decode across two "hosts" (network namespaces, tests/netns.py): P on host A and
D on host B, each transfer agent on its own host's address. Through a clean link D pulls
every prompt (the same tokens as one engine, only the last prompt token computed). With the
link cut while D pulls, D's pulls pass their deadline and D recomputes (same tokens) within
``load_timeout_s``, and P's offers expire so P frees every block within ``hold_timeout_s``.
Root only (skipped elsewhere, with the reason)."""

from __future__ import annotations

import time

import pytest

from tests.distributed.helpers import ENGINE, finish, prompts, run_engine, start_producer
from tests.netns import Network, netns_skip_reason

_SKIP = netns_skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

HOLD_S, LOAD_S = 8.0, 4.0  # the deadlines the cut link must reach
# Through the clean link no deadline may fire, however slowly the loaded machine starts D
# and compiles its programs (warm-up off): deadlines far from the test's own time.
CLEAN_HOLD_S, CLEAN_LOAD_S = 120.0, 60.0


def transfer(role: str, host, hold_s: float, load_s: float) -> dict:
    extra = {"host": host.address, "hold_timeout_s": hold_s, "load_timeout_s": load_s}
    if role == "kv_producer":  # an offline batch: every copy is offered before D pulls any
        extra["max_offered_bytes"] = 64 << 20
    return {
        "kv_connector": "JaxTransferConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def workload():
    from jaxkv import LLM, SamplingParams

    ps = prompts(8, seed=21)
    llm = LLM("tiny-llama", **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    llm.shutdown()
    return ps, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("cut", [False, True])
def test_pd_across_hosts(workload, tmp_path, cut):
    ps, want = workload
    deadlines = (HOLD_S, LOAD_S) if cut else (CLEAN_HOLD_S, CLEAN_LOAD_S)
    with Network(2) as net:
        a, b = net.hosts
        p_proc, params, p_out = start_producer(
            tmp_path,
            "p",
            ps,
            dict(
                ENGINE,
                kv_cache_memory_bytes=64 << 20,
                kv_transfer_config=transfer("kv_producer", a, *deadlines),
            ),
            drain_s=60,
            host=a,
        )
        assert all(p and a.address in p["remote_agents"][0]["transfer"] for p in params), params
        offered_at = time.monotonic()
        if cut:
            net.cut(b)
        t0 = time.monotonic()
        d = run_engine(
            tmp_path,
            "d",
            {
                "engine": dict(ENGINE, kv_transfer_config=transfer("kv_consumer", b, *deadlines)),
                "prompts": ps,
                "params": params,
            },
            host=b,
        )
        d_s = time.monotonic() - t0
        assert d["tokens"] == want
        assert d["free"] == d["total"]
        if cut:  # every pull failed: recomputed, after the load deadline, not much later
            assert d["failed_loads"] == len(ps) and d["external"] == 0, d
            assert LOAD_S <= d["elapsed_s"] < LOAD_S + 30, d["elapsed_s"]
        else:
            assert d["failed_loads"] == 0 and d["cached"] == [len(p) - 1 for p in ps], d
        p_res = finish(p_proc, p_out, tmp_path / "p.log")
        p_s = time.monotonic() - offered_at
        assert not p_res["pending_sends"] and p_res["free"] == p_res["total"], p_res
        print(
            f"P/D cut={cut}: D done in {d['elapsed_s']:.1f} s, P drained {p_s:.1f} s after offering"
        )
        if cut:  # nobody pulled: P's offers expired, P freed its blocks
            assert p_res["kv_stats"]["num_expired_offers"] == len(ps), p_res["kv_stats"]
            assert p_s < HOLD_S + d_s + 15, p_s
        assert a.wait_empty(10) and b.wait_empty(10)
