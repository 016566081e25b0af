"""Beam search (vLLM's ``LLM.beam_search``): the search on literal distributions, and the engine's
candidates against the dense forward's."""

import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import BeamSearchParams
from jaxkv.beam_search import beam_search_score, run_beam_search
from jaxkv.models import dense_forward
from jaxkv.outputs import Logprob
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model

EOS = 9


def _lp(probs: dict) -> dict:
    return {t: Logprob(math.log(p)) for t, p in probs.items()}


def test_search_on_a_literal_tree():
    """Next-token distributions written out: EOS completes a hypothesis, the best two by
    score go on, the length penalty decides between a short finished and a long one."""
    table = {
        (0,): {1: 0.6, 2: 0.3, EOS: 0.1},
        (0, 1): {3: 0.5, 4: 0.5},
        (0, 2): {EOS: 0.9, 5: 0.1},
        (0, 1, 3): {6: 1.0},
        (0, 1, 4): {7: 1.0},
        (0, 2, 5): {8: 1.0},
    }
    calls = []

    def expand(beams):
        calls.append([tuple(b) for b in beams])
        return [_lp(table[tuple(b)]) for b in beams]

    out = run_beam_search([[0]], BeamSearchParams(beam_width=2, max_tokens=3), expand, EOS)[0]
    # round 1 keeps [0,1] (0.6) and [0,2] (0.3); [0,EOS] completes. Round 2: [0,2,EOS] (0.27)
    # completes, [0,1,3] and [0,1,4] (0.3 each) go on; round 3 extends them with p = 1.
    assert calls == [[(0,)], [(0, 1), (0, 2)], [(0, 1, 3), (0, 1, 4)]]
    got = [(s.tokens, s.finish_reason) for s in out.sequences]
    # scores: [0,1,3,6] log(.3)/4 = -0.301, [0,2,EOS] log(.27)/2 = -0.655, [0,EOS] log(.1)/1
    assert got == [([0, 1, 3, 6], "length"), ([0, 1, 4, 7], "length")]
    assert out.sequences[0].cum_logprob == pytest.approx(math.log(0.3))
    assert len(out.sequences[0].logprobs) == 3
    # length_penalty=0: the score is the cumulative logprob alone
    out0 = run_beam_search(
        [[0]],
        BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=0.0),
        lambda bs: [_lp(table[tuple(b)]) for b in bs],
        EOS,
    )[0]
    assert [s.tokens for s in out0.sequences] == [[0, 1, 3, 6], [0, 1, 4, 7], [0, 2, EOS]]
    assert out0.sequences[2].finish_reason == "stop" and out0.sequences[2].stop_reason == EOS
    # length_penalty=2 favours the longer [0,2,5,8] (log .03 / 16) over [0,2,EOS] (log .27 / 4)
    out_lp = run_beam_search(
        [[0]],
        BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=2.0),
        lambda bs: [_lp(table[tuple(b)]) for b in bs],
        EOS,
    )[0]
    assert out_lp.sequences[2].tokens == [0, 2, 5, 8]
    # ignore_eos: EOS is an ordinary token
    out1 = run_beam_search(
        [[0]],
        BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True),
        lambda bs: [_lp(table[tuple(b)]) for b in bs],
        EOS,
    )[0]
    assert [s.tokens for s in out1.sequences] == [[0, 1]]
    # a beam that cannot grow (None: no room in max_model_len) completes as it stands
    out2 = run_beam_search(
        [[0]],
        BeamSearchParams(beam_width=2, max_tokens=4),
        lambda bs: [_lp(table[tuple(b)]) if len(b) < 2 else None for b in bs],
        EOS,
    )[0]
    assert sorted((s.tokens, s.finish_reason) for s in out2.sequences) == [
        ([0, 1], "length"),
        ([0, 2], "length"),
    ]
    assert beam_search_score([5, 6, EOS], -2.0, EOS, 1.0) == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width must be an int >= 1"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be an int >= 1"),
        (
            dict(beam_width=2, max_tokens=4, length_penalty=float("nan")),
            "length_penalty must be a finite",
        ),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    ],
)
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


@pytest.fixture(scope="module")
def model():
    return small_model("tiny-llama")


def _dense_expand(model, k):
    ref = weakref.ref(model)
    fwd = jax.jit(lambda ids: dense_forward(ref(), ids))

    def expand(beams):
        out = []
        for b in beams:
            ids = np.zeros((1, 128), np.int32)
            ids[0, : len(b)] = b
            row = np.asarray(fwd(jnp.asarray(ids))[0, len(b) - 1], np.float64)
            lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            top = np.argsort(-lp)[:k]
            out.append({int(t): Logprob(float(lp[t])) for t in top})
        return out

    return expand


def test_engine_beam_search_matches_the_dense_forward(model):
    """Two prompts, beam width 3, 4 rounds: the same hypotheses and scores as the search over
    the dense forward's log-softmax; beam width 1 is greedy decoding. Bad input leaves the
    engine usable and every block is returned."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, 21).tolist(), rng.integers(3, 512, 7).tolist()]
    llm = make_llm(model)
    eos = llm.llm_engine.input_processor.eos_token_id
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    got = llm.beam_search(prompts, params)
    want = run_beam_search(prompts, params, _dense_expand(model, 6), eos)
    for g, w in zip(got, want):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx(
            [s.cum_logprob for s in w.sequences], abs=1e-4
        )
        assert len(g.sequences) == 3
    assert llm.llm_engine.get_stats().prefix_hit_tokens > 0  # rounds reuse the beams' blocks

    (one,) = llm.beam_search(
        prompts[0], BeamSearchParams(beam_width=1, max_tokens=4, ignore_eos=True)
    )
    assert one.sequences[0].tokens[len(prompts[0]) :] == dense_greedy(model, prompts[0], 4)

    with pytest.raises(ValueError, match="beam search needs 1 .. max_model_len - 1"):
        llm.beam_search([[]], params)
    with pytest.raises(TypeError, match="must be BeamSearchParams"):
        llm.beam_search(prompts, {"beam_width": 2})
    with pytest.raises(ValueError, match="outside the vocabulary|vocab"):
        llm.beam_search([[1, 10**6]], params)
    assert_no_block_leaks(llm)


def test_eos_completes_hypotheses(model):
    """With EOS set to the prompt's most likely next token, the EOS hypothesis completes after
    one token ("stop") while the others go on, as in vLLM."""
    prompt = np.random.default_rng(5).integers(3, 512, 12).tolist()
    first = dense_greedy(model, prompt, 1)[0]
    eos_model = small_model("tiny-llama", eos_token_id=first)  # same weights, another EOS
    llm = make_llm(eos_model)
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0)
    (got,) = llm.beam_search([prompt], params)
    (want,) = run_beam_search([prompt], params, _dense_expand(eos_model, 4), first)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    stops = [s for s in got.sequences if s.finish_reason == "stop"]
    assert stops and stops[0].tokens == prompt + [first] and stops[0].stop_reason == first
    assert_no_block_leaks(llm)


def test_beams_stop_at_max_model_len(model):
    """A beam that fills max_model_len completes there ("length"), as in vLLM."""
    llm = make_llm(model, max_model_len=32)
    prompt = np.random.default_rng(7).integers(3, 512, 30).tolist()
    (out,) = llm.beam_search(
        [prompt], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    )
    assert [len(s.tokens) for s in out.sequences] == [32, 32]
    assert all(s.finish_reason == "length" for s in out.sequences)
    assert_no_block_leaks(llm)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(2, 4),
    depth=st.integers(1, 3),
    lp=st.sampled_from([0.0, 1.0, 2.0]),
    eos=st.booleans(),
)
def test_wide_beams_are_exhaustive_search(seed, vocab, depth, lp, eos):
    """With beams wider than every sequence there is (and 2 * width >= the vocabulary), nothing
    is pruned: the result is the best sequences by score among all of them, EOS ending some."""
    rng = np.random.default_rng(seed)
    table: dict = {}

    def dist(prefix):  # a fixed random next-token distribution per prefix
        if prefix not in table:
            p = rng.dirichlet(np.ones(vocab))
            table[prefix] = {t: Logprob(float(np.log(p[t]))) for t in range(vocab)}
        return table[prefix]

    eos_id = 0 if eos else None
    width = vocab**depth
    params = BeamSearchParams(beam_width=width, max_tokens=depth, length_penalty=lp)
    (out,) = run_beam_search([[9]], params, lambda beams: [dist(tuple(b)) for b in beams], eos_id)

    def complete(seq, cum):  # every finished sequence by plain recursion
        if len(seq) - 1 == depth or (eos_id is not None and len(seq) > 1 and seq[-1] == eos_id):
            yield seq, cum
            return
        for t, l in dist(tuple(seq)).items():
            yield from complete(seq + [t], cum + l.logprob)

    every = sorted(
        complete([9], 0.0), key=lambda sc: beam_search_score(sc[0], sc[1], eos_id, lp), reverse=True
    )
    assert [s.tokens for s in out.sequences] == [s for s, _ in every[:width]]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c in every[:width]])
