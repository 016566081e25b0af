"""Speculative decoding pieces: the n-gram proposer, its config, and draft verification."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.sampler import SamplingRows, processed_logits, sample, sample_and_verify
from jaxkv.worker.spec_decode import SpeculativeConfig, propose_ngram, verify_inputs
from tests.worker.sampler_helpers import rows as _rows
from tests.worker.sampler_helpers import write_state

verify_jit = jax.jit(functools.partial(sample_and_verify, num_logprobs=0))


def test_config_defaults_and_validation():
    c = SpeculativeConfig(num_speculative_tokens=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    assert SpeculativeConfig.from_value({"prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert SpeculativeConfig.from_value(None) is None
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1, got 0"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"unknown keys \['k'\]"):
        SpeculativeConfig.from_value({"k": 3})
    with pytest.raises(TypeError, match="must be a dict"):
        SpeculativeConfig.from_value("ngram")


def test_propose_ngram_literal():
    t = np.array([1, 2, 3, 9, 1, 2], np.int32)
    assert propose_ngram(t, 2, 2, 2) == [3, 9]
    assert propose_ngram(t, 1, 3, 5) == [3, 9, 1, 2]  # runs to the end of the tokens
    assert propose_ngram(np.array([5, 6, 7], np.int32), 1, 3, 2) == []
    # The longest n wins, then the most recent occurrence: [7, 8] at 3 beats [8] at 5.
    t = np.array([7, 8, 1, 7, 8, 2, 8, 3, 7, 8], np.int32)
    assert propose_ngram(t, 1, 2, 1) == [2]
    assert propose_ngram(t, 1, 1, 1) == [3]
    assert propose_ngram(t, 1, 2, 0) == []


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    lo=st.integers(1, 3),
    span=st.integers(0, 2),
    k=st.integers(1, 4),
)
def test_propose_ngram_matches_a_plain_search(tokens, lo, span, k):
    hi = lo + span
    want = []
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if starts:
            want = tokens[starts[-1] + n : starts[-1] + n + k]
            break
    assert propose_ngram(np.array(tokens, np.int32), lo, hi, k) == want


def _md(params, n_rows, seeds):
    return _rows(params, num_rows=n_rows, seeds=seeds, vocab=8)


def test_verify_greedy_accepts_exactly_the_argmax():
    logits = np.array(
        [[0, 5, 1, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 1], [0] * 7 + [2]], np.float32
    )
    md = _md([SamplingParams(temperature=0)] * 3, 3, [0, 0, 0])
    out, acc = verify_jit(logits, md, np.array([1, 7, -1], np.int32))
    assert np.asarray(out.sampled_token_ids).tolist() == [1, 0, 7]
    assert np.asarray(acc).tolist() == [True, False, False]


def test_verify_random_follows_the_target_distribution():
    """With a one-hot draft, keeping the draft when accepted and the residual draw otherwise
    gives tokens distributed as p; the draft is accepted with probability p(draft)."""
    n = 20000
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005], np.float32))
    p = np.exp(logits) / np.exp(logits).sum()
    md = _md([SamplingParams(temperature=1.0, seed=s) for s in range(n)], n, list(range(n)))
    for draft in (0, 3):
        out, acc = verify_jit(np.tile(logits, (n, 1)), md, np.full(n, draft, np.int32))
        toks, acc = np.asarray(out.sampled_token_ids), np.asarray(acc)
        freq = np.bincount(toks, minlength=8) / n
        np.testing.assert_allclose(freq, p, atol=0.015)
        assert abs(acc.mean() - p[draft]) < 0.015
        assert (toks[acc] == draft).all() and (toks[~acc] != draft).all()
    # No draft: the same draw as plain sampling would make for that output index.
    out, acc = verify_jit(np.tile(logits, (n, 1)), md, np.full(n, -1, np.int32))
    np.testing.assert_array_equal(
        out.sampled_token_ids,
        jax.jit(functools.partial(sample, num_logprobs=0))(
            np.tile(logits, (n, 1)), md
        ).sampled_token_ids,
    )
    assert not np.asarray(acc).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_positions_see_the_drafts_before_them(seed):
    """Each scored position's penalties, bad-word bans and min_tokens bans (``verify_inputs``'
    rows) equal those of its request with the drafts before the position appended as outputs."""
    rng = np.random.default_rng(seed)
    vocab, k = 16, 3
    params = [
        SamplingParams(
            temperature=0,
            repetition_penalty=1.5,
            frequency_penalty=0.7,
            bad_words_token_ids=[[5, 6], [7, 8, 9]],
        ),
        SamplingParams(temperature=0, presence_penalty=1.2),
        SamplingParams(temperature=0, bad_words_token_ids=[[2, 3, 4], [11]]),
        # 2 outputs so far: EOS (1) and 12 banned at positions 0 and 1 only
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[12]),
    ]
    tokens = [rng.integers(0, vocab, n).tolist() for n in (9, 6, 12, 7)]
    num_prompt = [4, 6, 5, 5]
    counts = [len(t) - p for t, p in zip(tokens, num_prompt)]
    drafts = [[5, 6], [3], [2, 3], [7, 8, 9]]  # row 0's draft 5 makes 6 a bad word after it
    state = write_state(
        params,
        prompts=[t[:p] for t, p in zip(tokens, num_prompt)],
        outputs=[t[p:] for t, p in zip(tokens, num_prompt)],
        eos_token_id=1,
        vocab=vocab,
    )
    qsl = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])]).astype(np.int32)
    row_data = {
        "slots": np.arange(4, dtype=np.int32),
        "num_output_tokens": np.array(counts, np.int32),
        "num_history_tokens": np.array([len(t) for t in tokens], np.int32),
        "num_logprobs": np.full(4, -1, np.int32),
        "samples": np.ones(4, bool),
    }
    x, index, start = verify_inputs(
        qsl,
        drafts,
        row_data,
        buckets=(16,),
        num_drafts=k,
        num_batch_rows=4,
        neutral_slot=state.neutral_slot,
    )
    P = int(qsl[-1])
    assert index[:P].tolist() == list(range(P)) and start.tolist() == qsl[:-1].tolist()
    positions = SamplingRows(
        state=state,
        slots=jnp.asarray(x.slots),
        num_output_tokens=jnp.asarray(x.num_output_tokens),
        num_history_tokens=jnp.asarray(x.num_history_tokens),
        num_logprobs=jnp.asarray(x.num_logprobs),
        prior_drafts=jnp.asarray(x.prior_drafts),
    )
    logits = rng.normal(size=(16, vocab)).astype(np.float32)
    got = np.asarray(jax.jit(processed_logits)(logits, positions))
    for p in range(P):
        r = int(np.searchsorted(qsl, p, side="right")) - 1
        j = p - int(qsl[r])
        ref = _rows(
            [params[r]],
            prompts=[tokens[r][: num_prompt[r]]],
            outputs=[tokens[r][num_prompt[r] :] + drafts[r][:j]],
            eos_token_id=1,
            vocab=vocab,
        )
        want = jax.jit(processed_logits)(logits[p : p + 1], ref)
        np.testing.assert_allclose(got[p], np.asarray(want)[0], rtol=1e-6, err_msg=f"position {p}")
    assert np.isneginf(got[1, 6])  # row 0 after its draft 5: the word [5, 6]
    last = int(qsl[3])  # row 3's positions: bans at offsets 0, 1, not 2, 3
    assert [bool(np.isneginf(got[last + j, 12])) for j in range(4)] == [True, True, False, False]
