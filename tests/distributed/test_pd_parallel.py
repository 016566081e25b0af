"""P/D device to device with several KV-cache groups (a sliding-window hybrid model), with
tensor parallelism on both sides (2 devices per instance, the head split matching), and with
each instance's workers in processes of their own (the multi-process executor). Each: D's
tokens equal a plain engine's, D computes only the last prompt token, no leaks on P or D."""

from __future__ import annotations

import pytest

from jaxkv import LLM, SamplingParams
from tests.distributed.helpers import ENGINE, finish, prompts, run_engine, start_producer
from tests.engine.helpers import assert_no_block_leaks

pytestmark = pytest.mark.slow  # engines and servers in several processes

PRODUCER = dict(ENGINE, kv_cache_memory_bytes=64 << 20)


def transfer(role):
    extra = {"load_timeout_s": 60.0}
    if role == "kv_producer":  # an offline batch: every copy is offered before D pulls any
        extra["max_offered_bytes"] = PRODUCER["kv_cache_memory_bytes"]
    return {
        "kv_connector": "JaxTransferConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def plain_tokens(model, ps, **engine):
    llm = LLM(model, **dict(ENGINE, **engine))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_hybrid_model_moves_every_group(tmp_path):
    """tiny-hybrid: full-attention and 128-token sliding-window groups; prompts up to 300
    tokens, so the window's early blocks are gone on P (null) and D skips them."""
    ps = prompts(8, lengths=[3, 40, 129, 150, 200, 257, 280, 300], seed=7)
    want = plain_tokens("tiny-hybrid", ps)
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer")),
        model="tiny-hybrid",
    )
    d = LLM("tiny-hybrid", kv_transfer_config=transfer("kv_consumer"), **ENGINE)
    outs = d.generate(
        [{"prompt_token_ids": p} for p in ps],
        [
            SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True, extra_args={"kv_transfer_params": kv}
            )
            for kv in params
        ],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in ps]
    assert d.llm_engine.engine_core.scheduler.num_failed_kv_loads == 0
    assert_no_block_leaks(d)
    d.shutdown()
    p_res = finish(p_proc, p_out, tmp_path / "p.log")
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_tensor_parallel_both_sides(tmp_path, backend):
    """TP 2 on P and on D: in one process over 2 devices ("uni"), or as 2 worker processes of
    one device each ("mp"): rank r of D pulls rank r's heads from rank r of P."""
    ps = prompts(6, seed=11)
    want = plain_tokens("tiny-llama", ps)
    par = dict(tensor_parallel_size=2, distributed_executor_backend=backend)
    devices = 2 if backend == "uni" else 1
    p_proc, params, p_out = start_producer(
        tmp_path,
        "p",
        ps,
        dict(PRODUCER, kv_transfer_config=transfer("kv_producer"), **par),
        devices=devices,
    )
    assert len(params[0]["remote_agents"]) == (1 if backend == "uni" else 2)
    d_res = run_engine(
        tmp_path,
        "d",
        {
            "engine": dict(ENGINE, kv_transfer_config=transfer("kv_consumer"), **par),
            "prompts": ps,
            "params": params,
        },
        devices=devices,
    )
    assert d_res["tokens"] == want
    assert d_res["cached"] == [len(p) - 1 for p in ps] and d_res["failed_loads"] == 0
    assert d_res["free"] == d_res["total"]
    if backend == "mp":  # each worker process pulled its own shard: the counters are summed
        stats = d_res["kv_stats"]
        assert [s["num_pulls"] for s in stats["per_rank"]] == [len(ps), len(ps)]
        assert stats["num_pulls"] == 2 * len(ps)
        assert stats["bytes_pulled"] == sum(s["bytes_pulled"] for s in stats["per_rank"]) > 0
    p_res = finish(p_proc, p_out, tmp_path / "p.log")
    assert not p_res["pending_sends"] and p_res["free"] == p_res["total"]
