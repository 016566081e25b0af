"""AsyncLLM over an engine-core process (tiny-llama, token-id prompts): streamed outputs equal
``LLM.generate``'s, a cancelled consumer frees its request's blocks in the core, pooling
requests, a refused request changes nothing, and a killed core fails waiting and new
requests with EngineDeadError at once (the last test: it kills the module's engine)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from jaxkv.engine.async_llm import AsyncLLM, EngineDeadError
from jaxkv.sampling_params import RequestOutputKind, SamplingParams

ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=4 << 20, max_num_seqs=4, warmup=False)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM("tiny-llama", startup_timeout_s=300, **ENGINE)
    yield eng
    eng.shutdown()


def _run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _collect(engine, prompt, params, rid):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


async def _idle(engine, deadline_s=20.0):
    """Waits until the core reports no request and no block in use."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        st = engine.scheduler_stats
        if st is not None and (st.num_running_reqs, st.num_waiting_reqs, st.kv_cache_usage) == (
            0,
            0,
            0.0,
        ):
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"the core is not idle: {engine.scheduler_stats}")


def test_core_loop_stops_when_its_front_end_is_gone():
    """EngineCoreProc.run returns at once when its parent is not the front end any more, busy
    or not (in-process, a stand-in core; nothing is stepped)."""
    import zmq

    from jaxkv.engine.core_client import EngineCoreProc

    class BusyCore:
        config = type("C", (), {"scheduler_config": type("S", (), {"async_scheduling": False})()})()
        steps = 0

        def has_unfinished_requests(self):
            return True

        def step(self):
            BusyCore.steps += 1
            raise AssertionError("stepped for a dead front end")

    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        t0 = time.monotonic()
        EngineCoreProc(BusyCore(), inp, out, parent_pid=os.getppid() + 1).run()
        assert BusyCore.steps == 0 and time.monotonic() - t0 < 3.0
    finally:
        inp.close(linger=0)
        out.close(linger=0)
        ctx.term()


def test_streams_equal_llm_generate(engine):
    from jaxkv import LLM

    ref = LLM("tiny-llama", **ENGINE).generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=0, n=2)
    )

    async def main():
        delta = SamplingParams(
            max_tokens=10, temperature=0, n=2, output_kind=RequestOutputKind.DELTA
        )
        final = SamplingParams(
            max_tokens=10, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        streams = await asyncio.gather(
            *(_collect(engine, p, delta, f"d{i}") for i, p in enumerate(PROMPTS)),
            *(_collect(engine, p, final, f"f{i}") for i, p in enumerate(PROMPTS)),
        )
        await _idle(engine)
        return streams

    streams = _run(main())
    for i, r in enumerate(ref):
        tokens = {0: [], 1: []}
        for out in streams[i]:
            for c in out.outputs:
                tokens[c.index] += c.token_ids
        assert tokens == {j: r.outputs[j].token_ids for j in range(2)}
        assert streams[i][-1].finished and len(streams[2 + i]) == 1
        assert streams[2 + i][0].outputs[0].token_ids == r.outputs[0].token_ids


def test_cancelled_consumer_frees_its_blocks_and_bad_input_changes_nothing(engine):
    async def main():
        params = SamplingParams(
            max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        seen = 0

        async def consume():
            nonlocal seen
            async for _ in engine.generate(list(range(1, 60)), params, "long"):
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 2:
            await asyncio.sleep(0.01)
        assert engine.scheduler_stats.kv_cache_usage > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _idle(engine)
        assert engine.get_num_unfinished_requests() == 0
        with pytest.raises(ValueError, match="top_k"):
            await _collect(engine, [1, 2], SamplingParams(top_k=10**6), "bad")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, [10**6], None, "bad")
        assert engine.get_num_unfinished_requests() == 0
        outs = [o async for o in engine.encode([1, 2, 3], None, "emb")]
        assert outs[0].finished and outs[0].outputs.data.shape == (engine.model_config.hidden_size,)
        await _idle(engine)

    _run(main())


def test_killed_core_fails_requests_at_once(engine):  # last: kills the module's engine
    async def main():
        params = SamplingParams(
            max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        got = asyncio.Event()

        async def consume():
            async for _ in engine.generate([1, 2, 3], params, "doomed"):
                got.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got.wait(), 60)
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(task, 10)
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            await _collect(engine, [1, 2], None, "after")
        assert engine.errored

    _run(main())
