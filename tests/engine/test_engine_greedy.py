"""Engine paths against the dense, non-paged forward of the same weights (greedy, fp32)."""

import numpy as np
import pytest

from jaxkv.sampling_params import SamplingParams
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FAMILIES = ["tiny-llama", "tiny-hybrid"]


def _prompts(rng, lengths, vocab=512):
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def _assert_matches_dense(model, prompts, outs, max_tokens=8):
    for p, o in zip(prompts, outs):
        assert o.finished
        assert o.outputs[0].token_ids == dense_greedy(model, p, max_tokens), p[:5]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, small_model(request.param)


def test_preemption_small_pool(family_model):
    """(a) So few blocks that requests get preempted and recomputed."""
    family, model = family_model
    llm = make_llm(model, num_gpu_blocks_override=12, max_num_seqs=4)
    prompts = _prompts(np.random.default_rng(0), [40, 45, 50, 35])
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert llm.llm_engine.get_stats().num_preemptions > 0
    _assert_matches_dense(model, prompts, outs, max_tokens=24)
    assert_no_block_leaks(llm)


def test_prefix_cache_hits_and_chunked_prefill(family_model):
    """(b) prefix hits across requests and (c) chunked prefill under a 16-token budget."""
    family, model = family_model
    llm = make_llm(model, max_num_batched_tokens=16, max_num_seqs=4)
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 512, size=48).tolist()
    first = [shared + rng.integers(3, 512, size=5).tolist()]
    outs1 = llm.generate(first, GREEDY, use_tqdm=False)
    later = [shared + rng.integers(3, 512, size=n).tolist() for n in (3, 9)]
    outs2 = llm.generate(later, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs2), [o.num_cached_tokens for o in outs2]
    _assert_matches_dense(model, first + later, outs1 + outs2)
    assert_no_block_leaks(llm)


def test_mixed_lengths_and_abort(family_model):
    """(d) mixed prompt and output lengths, with an abort in the middle."""
    family, model = family_model
    llm = make_llm(model)
    engine = llm.llm_engine
    rng = np.random.default_rng(2)
    prompts = _prompts(rng, [3, 30, 17, 60, 1])
    max_toks = [5, 9, 3, 7, 11]
    for i, (p, m) in enumerate(zip(prompts, max_toks)):
        engine.add_request(
            f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
    done = {}
    for step in range(200):
        if step == 3:
            engine.abort_request("r1")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert "r1" not in done
    for i in (0, 2, 3, 4):
        assert done[f"r{i}"].outputs[0].token_ids == dense_greedy(model, prompts[i], max_toks[i])
    assert_no_block_leaks(llm)


def test_n_greater_than_one(family_model):
    """(e) n > 1 completions share the prompt; greedy gives n identical copies of the reference."""
    family, model = family_model
    llm = make_llm(model)
    prompt = _prompts(np.random.default_rng(3), [37])[0]
    (out,) = llm.generate(
        [prompt],
        SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    ref = dense_greedy(model, prompt, 6)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == ref for c in out.outputs)
    assert_no_block_leaks(llm)


def test_greedy_decode_steps_are_one_program():
    """A greedy step of T <= max_num_seqs tokens whose sampled rows' bucket S is >= T takes its
    tokens in the forward itself (no ``greedy[S]`` after it); a step with fewer sampled rows
    than its token bucket (a 40-token prompt: T = 48, S = 1) still runs ``greedy[S]``.
    Tokens equal the dense forward's either way, with or without async scheduling."""
    model = small_model("tiny-llama")
    rng = np.random.default_rng(3)
    for async_scheduling in (False, True):
        llm = make_llm(
            model, max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_scheduling
        )
        runner = llm.llm_engine.runner
        calls, real_run = [], runner._run
        runner._run = lambda kind, size, *a, calls=calls, run=real_run: (
            calls.append((kind, size)),
            run(kind, size, *a),
        )[1]
        prompts = _prompts(rng, [40])
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert ("greedy", 1) in calls, calls  # prefill: T = 48 > S = 1
        assert calls.count(("forward", 1)) == GREEDY.max_tokens - 1, calls
        calls.clear()
        prompts2 = _prompts(rng, [3, 5, 7, 2, 4])
        outs += llm.generate(prompts2, GREEDY, use_tqdm=False)
        # the prefill (21 tokens: T = 24 > 8 rows) runs greedy[8]; every decode step (T = 8) is one program
        assert calls.count(("forward", 8)) == GREEDY.max_tokens - 1, calls
        assert [c for c in calls if c[0] == "greedy"] == [("greedy", 8)], calls
        _assert_matches_dense(model, prompts + prompts2, outs)
        assert_no_block_leaks(llm)
