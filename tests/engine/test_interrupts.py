"""KeyboardInterrupt at many points of ``LLM.generate`` never wedges or leaks the engine.

Two sweeps over the time a generate takes:
- Ctrl-C as the user sends it (SIGINT, through Python's handler): the engine holds it until
  the request being added or the step being run is done, then raises between steps;
- a KeyboardInterrupt raised at an arbitrary bytecode (a SIGALRM handler that raises), which
  can land inside a jitted call whose inputs were donated or inside a half-updated host
  structure: the step's recovery must repair that.
After each: generate raised KeyboardInterrupt (or finished first), no request is unfinished,
every block is free, the scheduler's invariants hold and the same prompts give the dense
forward's greedy tokens.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time

import numpy as np
import pytest

from jaxkv.core.consistency import scheduler_problems
from jaxkv.interrupts import DeferredInterrupt
from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [
    np.random.default_rng(i).integers(3, 512, size=n).tolist()
    for i, n in ((1, 40), (2, 23), (3, 70))
]


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Python's own SIGINT handler, as a user's program has it: a test that ran before in
    this process may have left another one (a library's; never jaxkv's own, checked)."""
    found = signal.getsignal(signal.SIGINT)
    assert not isinstance(getattr(found, "__self__", None), DeferredInterrupt), (
        "jaxkv left its handler"
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


@pytest.fixture(scope="module")
def model():
    return small_model("tiny-llama")


@pytest.fixture(scope="module")
def reference(model):
    return [dense_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model)


def _generate(llm):
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _check(llm, reference) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert_no_block_leaks(llm)
    assert scheduler_problems(engine.scheduler) == []
    assert [o.outputs[0].token_ids for o in _generate(llm)] == reference
    assert_no_block_leaks(llm)


def _duration(llm) -> float:
    _generate(llm)  # compiles
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _generate(llm)
        best = min(best, time.perf_counter() - t0)
    return best


def test_ctrl_c_sweep(llm, reference):
    """SIGINT at 16 points across a generate (and past its end)."""
    span = _duration(llm)
    interrupted = 0
    for fraction in np.linspace(0.0, 1.2, 16):
        timer = threading.Timer(float(fraction * span), _thread.interrupt_main)
        try:
            t0 = time.perf_counter()
            timer.start()
            _generate(llm)
            if fraction < 1.0:
                span = time.perf_counter() - t0  # this machine runs faster now
            timer.join()
            time.sleep(0.01)  # an interrupt that came after generate lands here
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            timer.join()
        _check(llm, reference)
    assert interrupted >= 8, interrupted


@pytest.mark.slow
def test_arbitrary_point_interrupt_sweep(llm, reference):
    """A KeyboardInterrupt raised at an arbitrary bytecode, at 30 points across a generate."""
    span = _duration(llm)

    def raise_now(signum, frame):
        raise KeyboardInterrupt("alarm")

    old = signal.signal(signal.SIGALRM, raise_now)
    interrupted = 0
    try:
        # A fraction of the span, not a fixed delay: a generate that ran whole tells how
        # long one takes now (a noisy machine's speed changes over the sweep).
        for fraction in np.linspace(1e-3, 1.1, 30):
            try:
                t0 = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, float(fraction * span))
                _generate(llm)
                signal.setitimer(signal.ITIMER_REAL, 0)
                span = time.perf_counter() - t0
            except KeyboardInterrupt:
                interrupted += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            _check(llm, reference)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert interrupted >= 12, interrupted


def test_ctrl_c_during_a_step_completes_it_first(llm, reference):
    """LLMEngine.step: a SIGINT inside the step is raised after it; the step's outputs are
    returned by the next call, and the requests carry on to the right tokens."""
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"c{i}", p, GREEDY)
    real = engine.runner._fetch

    def fetch(*args):
        _thread.interrupt_main()  # SIGINT while the step runs
        return real(*args)

    engine.runner._fetch = fetch
    try:
        with pytest.raises(KeyboardInterrupt, match="the step completed"):
            engine.step()
    finally:
        engine.runner._fetch = real
    assert engine.has_unfinished_requests()
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done == {f"c{i}": ref for i, ref in enumerate(reference)}
    _check(llm, reference)


@pytest.mark.parametrize("where", ["output_processor", "engine_core"])
def test_interrupt_inside_add_request_leaves_nothing_behind(llm, reference, where):
    """An interrupt in either half of add_request (the front end's record, the core's queue)
    leaves no request behind once generate has aborted its ids; this point was once missed
    by the arbitrary-point sweep 1 run in ~1000."""
    engine = llm.llm_engine
    target = engine.output_processor if where == "output_processor" else engine.engine_core
    name = "add_request" if where == "output_processor" else "add_requests"
    real = getattr(target, name)
    calls = []

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the second prompt: one request is queued whole already
            raise KeyboardInterrupt("inside add_request")

    setattr(target, name, interrupted)
    try:
        with pytest.raises(KeyboardInterrupt, match="inside add_request"):
            _generate(llm)
    finally:
        setattr(target, name, real)
    assert len(calls) == 2
    _check(llm, reference)


def test_second_ctrl_c_raises_at_once():
    with pytest.raises(KeyboardInterrupt), DeferredInterrupt() as guard:
        signal.raise_signal(signal.SIGINT)
        assert guard.pending  # held
        signal.raise_signal(signal.SIGINT)  # raises here
        pytest.fail("the second SIGINT did not raise")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_guard_leaves_other_handlers_and_threads_alone():
    seen = []
    old = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    try:
        with DeferredInterrupt() as guard:
            signal.raise_signal(signal.SIGINT)
        assert seen == [signal.SIGINT] and not guard.pending
    finally:
        signal.signal(signal.SIGINT, old)
    result = []
    t = threading.Thread(target=lambda: result.append(DeferredInterrupt().__enter__()._installed))
    t.start()
    t.join()
    assert result == [False]
