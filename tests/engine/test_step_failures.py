"""A step that fails at any stage leaves the engine usable, leak-free and with a clean prefix cache.

For each stage a step can fail at (schedule, part-way through schedule, dispatch, inside the
jitted step, collect, update, output processing) and each kind of step (prefill, decode, a
chunked prefill mixed with a decode, with n-gram drafts, pooling; async scheduling on and
off), an exception is injected once. Afterwards: no request is unfinished, every block is
free, the scheduler's invariants hold, and the same greedy prompts (prefix caching on, so a
block cached for KV that was never written would be served as a hit) give the tokens of the
dense forward.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
import pytest

from jaxkv.core.consistency import scheduler_problems
from jaxkv.core.errors import EngineStepError
from jaxkv.pooling_params import PoolingParams
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.program_set import FORWARD
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MAX_TOKENS = 6


class InjectedError(Exception):
    """The exception the tests inject."""


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


#: 40 tokens (two full blocks, cached when scheduled), 23, and 70 (chunked: budget 64).
PROMPTS = [_prompt(1, 40), _prompt(2, 23), _prompt(3, 70)]
#: A prompt that repeats itself, so n-gram drafts are proposed while it decodes.
REPEATING = (_prompt(4, 8) * 5)[:36]


@pytest.fixture(scope="module")
def model():
    return small_model("tiny-llama")


@pytest.fixture(scope="module")
def reference(model):
    return [dense_greedy(model, p, MAX_TOKENS) for p in PROMPTS + [REPEATING]]


@pytest.fixture(scope="module")
def sync_llm(model):
    return make_llm(model)


@pytest.fixture(scope="module")
def async_llm(model):
    return make_llm(model, async_scheduling=True)


@pytest.fixture(scope="module")
def spec_llm(model):
    return make_llm(
        model,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    )


@contextlib.contextmanager
def fail_once(obj, name: str, *, after: bool = False, on_call: int = 1):
    """``obj.name`` raises ``InjectedError`` on its ``on_call``-th call (before doing anything, or
    ``after`` the real call did its work); restored on exit."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] != on_call:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise InjectedError(f"injected into {name}")

    setattr(obj, name, wrapper)
    try:
        yield calls
    finally:
        setattr(obj, name, real)


@contextlib.contextmanager
def fail_in_jitted_step(runner):
    """The next step fails inside its forward program (a host callback that raises), after its
    inputs, the KV buffers among them, were donated. The forwards are rebuilt with the
    callback (and put back on exit)."""
    programs = runner.programs
    real_build, real_compiled = programs._build, dict(programs._compiled)
    armed = [True]

    def check(x):
        if armed[0]:
            armed[0] = False
            raise InjectedError("injected inside the jitted step")
        return x

    def build(key):
        program = real_build(key)
        if key.kind != FORWARD:
            return program

        def forward(*args):
            buffers, tables, hidden, selected, *rest = program.fn(*args)
            selected = jax.pure_callback(
                check, jax.ShapeDtypeStruct(selected.shape, selected.dtype), selected
            )
            return buffers, tables, hidden, selected, *rest

        return dataclasses.replace(program, fn=forward)

    programs._build = build
    programs._compiled = {k: v for k, v in real_compiled.items() if k.kind != FORWARD}
    try:
        yield
    finally:
        programs._build = real_build
        programs._compiled = {**programs._compiled, **real_compiled}


def injection(llm, stage: str):
    engine = llm.llm_engine
    return {
        "schedule": lambda: fail_once(engine.scheduler, "schedule", after=True),
        "schedule_mid": lambda: fail_once(
            engine.scheduler.kv_cache_manager, "allocate_slots", on_call=2
        ),
        "dispatch": lambda: fail_once(engine.runner, "_to_device"),
        "jitted_step": lambda: fail_in_jitted_step(engine.runner),
        "collect": lambda: fail_once(engine.runner, "_fetch", after=True),
        "update": lambda: fail_once(engine.scheduler, "update_from_output"),
        "process": lambda: fail_once(engine.output_processor, "_process_one"),
    }[stage]()


def _decoding(engine) -> bool:
    sched = engine.scheduler
    return (
        bool(sched.running)
        and not sched.waiting
        and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
    )


def run_and_fail(llm, stage: str, kind: str) -> EngineStepError | BaseException:
    """Adds requests, steps until a step of ``kind`` is next, injects a failure at ``stage``
    and steps on until the engine raises; returns the exception."""
    engine = llm.llm_engine
    if kind == "pooling":
        engine.add_request("pool", PROMPTS[0], PoolingParams())
        ready = lambda: True  # noqa: E731
    elif kind == "mixed":  # one request decodes while a long one runs its first chunk
        engine.add_request("a", PROMPTS[1], GREEDY)
        while not _decoding(engine):
            engine.step()
        engine.add_request("b", PROMPTS[2], GREEDY)
        ready = lambda: True  # noqa: E731
    elif kind == "spec":
        engine.add_request(
            "s", REPEATING, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        ready = lambda: any(r.spec_token_ids for r in engine.scheduler.running)  # noqa: E731
    else:
        for i, p in enumerate(PROMPTS[:2]):
            engine.add_request(f"{kind}{i}", p, GREEDY)
        ready = {"prefill": lambda: True, "decode": lambda: _decoding(engine)}[kind]
    for _ in range(50):
        if ready():
            break
        engine.step()
    else:
        raise AssertionError(f"no {kind} step came")
    with pytest.raises(BaseException) as info:
        with injection(llm, stage):
            for _ in range(50):
                engine.step()
    return info.value


def drain(llm, reference) -> dict:
    """Steps the requests a failure left alive to their end; each that was not aborted
    must have its prompt's greedy tokens (request ids end in their prompt's index)."""
    engine = llm.llm_engine
    done = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, out in done.items():
        if not isinstance(out.outputs, list):
            continue  # a pooling output
        want = reference[int(rid[-1])] if rid[-1].isdigit() else None
        assert out.outputs[0].finish_reason == "length", (rid, out)
        if want is not None:
            assert out.outputs[0].token_ids == want, rid
    return done


def check_recovered(llm, reference, *, prompts=None) -> None:
    """No request left, no block held, invariants hold, and greedy tokens are right."""
    engine = llm.llm_engine
    drain(llm, reference)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    assert_no_block_leaks(llm)
    assert scheduler_problems(engine.scheduler) == []
    idx = range(len(PROMPTS)) if prompts is None else prompts
    outs = llm.generate([(PROMPTS + [REPEATING])[i] for i in idx], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[i] for i in idx]
    assert_no_block_leaks(llm)
    assert scheduler_problems(engine.scheduler) == []


STAGES = ["schedule", "schedule_mid", "dispatch", "jitted_step", "collect", "update", "process"]


@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("stage", STAGES)
def test_failed_step_sync(sync_llm, reference, stage, kind):
    if stage == "schedule_mid" and kind == "decode":
        pytest.skip("a decode step of two rows allocates at most once per row: covered by prefill")
    err = run_and_fail(sync_llm, stage, kind)
    assert isinstance(err, EngineStepError), err
    assert isinstance(err.__cause__, InjectedError) or "InjectedError" in str(err)
    assert err.aborted_request_ids, err
    assert err.kv_cache_lost == (stage == "jitted_step")
    if stage == "process":  # the request whose output failed is named
        assert err.request_id in err.aborted_request_ids
    check_recovered(sync_llm, reference)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize(
    "stage", ["schedule", "dispatch", "jitted_step", "collect", "update", "process"]
)
def test_failed_step_async(async_llm, reference, stage, kind):
    err = run_and_fail(async_llm, stage, kind)
    assert isinstance(err, EngineStepError), err
    check_recovered(async_llm, reference)


@pytest.mark.parametrize("stage", ["dispatch", "jitted_step", "collect", "process"])
def test_failed_step_with_drafts(spec_llm, reference, stage):
    err = run_and_fail(spec_llm, stage, "spec")
    assert isinstance(err, EngineStepError) and "s" in err.aborted_request_ids
    check_recovered(spec_llm, reference, prompts=[0, 3])


@pytest.mark.parametrize("stage", ["schedule", "dispatch", "jitted_step", "collect", "process"])
def test_failed_pooling_step(sync_llm, reference, stage):
    before = sync_llm.encode([PROMPTS[0]], use_tqdm=False)[0].outputs.data
    err = run_and_fail(sync_llm, stage, "pooling")
    assert isinstance(err, EngineStepError) and err.aborted_request_ids == ("pool",)
    check_recovered(sync_llm, reference, prompts=[0])
    after = sync_llm.encode([PROMPTS[0]], use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_requests_outside_the_failed_step_carry_on(model, reference):
    """With room for two requests a step, the third waits: it is not in the failed step, so
    it survives, and it is recomputed correctly after the KV buffers were lost."""
    llm = make_llm(model, max_num_seqs=2)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    with fail_in_jitted_step(engine.runner), pytest.raises(EngineStepError) as info:
        engine.step()
    assert sorted(info.value.aborted_request_ids) == ["0", "1"] and info.value.kv_cache_lost
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(outs) == ["2"] and outs["2"].outputs[0].token_ids == reference[2]
    check_recovered(llm, reference)


def test_failed_step_aborts_every_completion_of_a_prompt(sync_llm, reference):
    """n = 2: both completions of the prompt end together, with abort outputs nowhere."""
    engine = sync_llm.llm_engine
    engine.add_request("n2", PROMPTS[1], SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=1))
    with fail_once(engine.runner, "_fetch", after=True), pytest.raises(EngineStepError) as info:
        engine.step()
    assert info.value.aborted_request_ids == ("n2",)
    check_recovered(sync_llm, reference, prompts=[1])


def test_output_processing_failure_keeps_other_outputs(sync_llm, reference):
    """One request's output processing fails: it is aborted; the other request of the step
    is processed, keeps its tokens and finishes normally."""
    engine = sync_llm.llm_engine
    engine.add_request("ok", PROMPTS[0], GREEDY)
    engine.add_request("bad", PROMPTS[1], GREEDY)
    real = engine.output_processor._process_one

    def process_one(co, now, touched):
        if co.request_id == "bad":
            raise InjectedError("bad output")
        return real(co, now, touched)

    engine.output_processor._process_one = process_one
    try:
        with pytest.raises(EngineStepError) as info:
            engine.step()
    finally:
        engine.output_processor._process_one = real
    assert info.value.request_id == "bad" and info.value.aborted_request_ids == ("bad",)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(done) == ["ok"] and done["ok"].outputs[0].token_ids == reference[0]
    check_recovered(sync_llm, reference)


def test_unwritten_blocks_are_not_served_as_hits(model, reference):
    """The schedule caches the prompt's full blocks before the step runs; the step fails;
    the same prompt again must not hit them (prefix caching on)."""
    llm = make_llm(model)
    engine = llm.llm_engine
    engine.add_request("x", PROMPTS[0], GREEDY)
    with fail_once(engine.runner, "_to_device"), pytest.raises(EngineStepError):
        engine.step()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.cached_block_hash_to_block.num_blocks() == 0
    out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference[0]
    again = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]  # now written: a real hit
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == reference[0]
