"""Async scheduling end to end: the same tokens as the synchronous engine and the dense forward.

With ``async_scheduling=True`` the engine dispatches step N+1 before it fetches step N, and
step N+1 reads N's sampled tokens on the device. Greedy, seeded and unseeded sampling,
min_tokens, logprobs, prompt logprobs, n > 1, stop ids, penalties (the step counts the token
it reads from the device), preemption and aborts must all give what the synchronous engine
gives, and free every block.
"""

import numpy as np
import pytest

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.forward import ForwardInputs
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model
from tests.engine.test_engine_greedy import _prompts


@pytest.fixture(scope="module")
def model():
    return small_model("tiny-llama")


def _generate(model, prompts, params, **kwargs):
    llm = make_llm(model, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_block_leaks(llm)
    return llm, outs


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-hybrid"])
def test_async_greedy_with_preemption_matches_dense(family):
    model = small_model(family)
    prompts = _prompts(np.random.default_rng(0), [40, 45, 50, 35])
    llm, outs = _generate(
        model,
        prompts,
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        num_gpu_blocks_override=12,
        max_num_seqs=4,
        async_scheduling=True,
    )
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == dense_greedy(model, p, 20)


def _ranks(logprobs):  # per position {token: rank}: exact across engines
    return (
        None
        if logprobs is None
        else [None if d is None else {t: x.rank for t, x in d.items()} for d in logprobs]
    )


def _values(logprobs):  # the logprob values, flattened
    return [] if logprobs is None else [x.logprob for d in logprobs if d for x in d.values()]


def test_async_sampling_variants_match_sync(model):
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, [9, 30, 17, 44, 5, 23, 12, 38])
    params = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, ignore_eos=True),  # engine-seeded
        SamplingParams(
            max_tokens=10,
            temperature=0.9,
            repetition_penalty=1.4,
            presence_penalty=0.5,
            ignore_eos=True,
        ),  # penalties
        SamplingParams(max_tokens=9, temperature=0.7, min_tokens=6, logprobs=3, seed=3),
        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=1.0, seed=8, stop_token_ids=[]),
    ]
    # Each engine runs the batch twice (the second time with prefix-cache hits); a stop id
    # the first sync run samples mid-way ends request 7 early in the second runs.
    llms = {
        mode: make_llm(model, max_num_batched_tokens=32, async_scheduling=mode)
        for mode in (False, True)
    }
    first = {mode: llm.generate(prompts, params, use_tqdm=False) for mode, llm in llms.items()}
    stop_at = first[False][7].outputs[0].token_ids[4]
    params[7] = SamplingParams(max_tokens=15, temperature=1.0, seed=8, stop_token_ids=[stop_at])
    results, values = {}, {}
    for mode, llm in llms.items():
        outs = first[mode] + llm.generate(prompts, params, use_tqdm=False)
        assert_no_block_leaks(llm)
        results[mode] = [
            (
                [c.token_ids for c in o.outputs],
                [_ranks(c.logprobs) for c in o.outputs],
                [c.finish_reason for c in o.outputs],
                _ranks(o.prompt_logprobs),
            )
            for o in outs
        ]
        values[mode] = [_values(c.logprobs) for o in outs for c in o.outputs]
    assert results[True] == results[False]
    # Logprob values: the two engines batch rows differently (async schedules a row again
    # before it sees the row's stop), and another batch shape may round differently.
    for got, want in zip(values[True], values[False]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert results[True][8 + 7][2] == ["stop"] and len(results[True][8 + 7][0][0]) <= 5
    assert results[True][4][1][0] and len(results[True][4][0][0]) >= 6


def _count_inputs_from_device(runner) -> list[int]:
    """Per dispatched step, how many input tokens it reads from the step in flight."""
    counts = []
    real = runner._to_device

    def spy(record):
        if isinstance(record, ForwardInputs):
            counts.append(int((record.prev_rows >= 0).sum()))
        return real(record)

    runner._to_device = spy
    return counts


def test_async_pipelines_one_step(model):
    """The first step returns nothing and leaves a step in flight; later steps feed tokens
    from the device (``prev_rows``), and the request's outputs still arrive in order."""
    llm = make_llm(model, async_scheduling=True)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    from_device = _count_inputs_from_device(runner)
    prompt = _prompts(np.random.default_rng(2), [21])[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert engine.step() == [] and engine.engine_core._in_flight is not None
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == dense_greedy(model, prompt, 6)
    assert from_device == [0, 1, 1, 1, 1, 1]  # every decode input came from the device
    assert engine.engine_core._in_flight is None and runner._in_flight is None


def test_async_abort_with_a_step_in_flight(model):
    llm = make_llm(model, async_scheduling=True)  # stop strings: test_engine_behaviour
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", _prompts(np.random.default_rng(10 + i), [12])[0], params)
    done = {}
    for step in range(100):
        if step == 3:
            engine.abort_request("r1")  # a step for r1 is in flight: its token is dropped
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert sorted(done) == ["r0", "r2"] and all(
        len(o.outputs[0].token_ids) == 10 for o in done.values()
    )
    assert_no_block_leaks(llm)

    # An aborted id whose step is still in flight cannot be reused until that step is collected.
    prompt = _prompts(np.random.default_rng(20), [12])[0]
    engine.add_request("x", prompt, params)
    engine.step()
    engine.step()
    engine.abort_request("x")
    with pytest.raises(ValueError, match="'x' is still in the step in flight"):
        engine.add_request("x", prompt, params)
    engine.step()
    engine.add_request("x", prompt, params)
    outs = [
        o
        for _ in range(40)
        if engine.has_unfinished_requests()
        for o in engine.step()
        if o.finished
    ]
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(model, prompt, 10)]
    assert_no_block_leaks(llm)


def test_penalised_rows_follow_their_step_in_flight(model):
    """A row with penalties is scheduled while its previous token is still on the device: the
    step counts that token (its input, read from the device; not in the host's history yet),
    so the tokens equal the synchronous engine's, and no step waits for the one in flight."""
    prompts = _prompts(np.random.default_rng(3), [6, 11])
    # Negative penalties favour tokens already generated, the previous one (the token in
    # flight) included: a step that did not count it would pick another token.
    params = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        frequency_penalty=-2.0,
        presence_penalty=-1.0,
        repetition_penalty=1.5,
        ignore_eos=True,
    )
    want = [
        o.outputs[0].token_ids for o in make_llm(model).generate(prompts, params, use_tqdm=False)
    ]
    assert want[0] != dense_greedy(model, prompts[0], 24)  # the penalties change the tokens
    llm = make_llm(model, async_scheduling=True)
    runner = llm.llm_engine.runner
    from_device = _count_inputs_from_device(runner)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert from_device == [0] + [2] * 23  # every decode step followed the one in flight
    assert_no_block_leaks(llm)
