"""Sampler: greedy exactness, truncation masks, penalties, per-request seeds, logprobs, bans.

Every row's options come from its slot of a device SamplingState written exactly as the runner
writes it (``tests/worker/sampler_helpers.py``); the programs compile once whatever the rows
ask for, so these tests run one jitted ``sample`` over every mix.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.logits_ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    argmax,
    bad_word_bans,
    compute_logprobs,
    latest_outputs,
)
from jaxkv.worker.sampler import sample, sample_greedy_vocab_major
from jaxkv.worker.sampling_state import PAD_TOKEN_ID
from jaxkv.worker.sampling_updates import make_request_key, make_unseeded_request_key
from tests.worker.sampler_helpers import V, write_state
from tests.worker.sampler_helpers import logits as _logits
from tests.worker.sampler_helpers import rows as _rows

K = 4  # the programs' logprob columns in these tests (the engine's max_logprobs)
sample_jit = jax.jit(functools.partial(sample, num_logprobs=K))


def test_argmax_equals_numpy_first_max_with_ties_inf_and_nan():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(64, 40)).astype(np.float32)  # many ties
    x[1] = -np.inf  # all -inf -> 0
    x[2, [5, 9]] = np.nan  # first NaN wins (numpy rule)
    x[3, [7, 30]] = np.inf
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[1] == 0 and got[2] == 5 and got[3] == 7
    assert got.dtype == np.int32


@pytest.mark.parametrize("vocab", [640, 1024, 32000])
def test_chunked_argmax_equals_numpy_first_max(vocab):
    """Vocabularies with a divisor in [64, 512] take the chunked path: the first chunk holding
    the maximum (or a NaN) is searched, so ties across chunks and NaNs in later chunks count."""
    from jaxkv.worker.logits_ops import _argmax_chunk

    c = _argmax_chunk(vocab)
    assert c is not None and vocab % c == 0 and vocab // c > 1
    rng = np.random.default_rng(vocab)
    x = rng.integers(-40, 3, size=(16, vocab)).astype(np.float32)  # ties within and across chunks
    x[1] = -np.inf  # all -inf -> 0
    x[2, [vocab - 1, c + 3]] = np.nan  # first NaN, not in chunk 0
    x[3, [vocab - 2, 5]] = np.inf
    x[4] = 0.0
    x[4, [c - 1, c, vocab - 1]] = 1.0  # tie at a chunk boundary
    x[5, vocab - 1] = 9.0  # max in the last chunk
    x[6] = rng.standard_normal(vocab)
    x[6, 2 * c - 1] = np.nan  # NaN beats a larger max
    x[6, 0] = 100.0
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[2] == c + 3 and got[4] == c - 1 and got[5] == vocab - 1 and got[6] == 2 * c - 1
    # Along axis 0 ([V, S]) the same tokens, and the fast path agrees once no NaN / inf sends
    # the batch to the exact path.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: argmax(v, axis=0))(x.T)), got)
    finite = np.nan_to_num(x, nan=0.0, posinf=50.0, neginf=-50.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(finite)), np.argmax(finite, axis=-1))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda v: argmax(v, axis=0))(finite.T)), np.argmax(finite, axis=-1)
    )


def test_greedy_is_argmax_also_in_mixed_batch():
    logits = _logits(6)
    out = sample_jit(logits, _rows([SamplingParams(temperature=0.0)] * 5, num_rows=6))
    np.testing.assert_array_equal(out.sampled_token_ids, logits.argmax(-1))
    # Mixed: rows 0, 2, 4 greedy, the others random; greedy rows are still the exact argmax.
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, seed=i) for i in range(6)]
    out = np.asarray(sample_jit(logits, _rows(params)).sampled_token_ids)
    np.testing.assert_array_equal(out[::2], logits.argmax(-1)[::2])


def test_greedy_is_argmax_of_penalised_logits():
    logits = _logits(2, seed=3)
    prompts, outputs = [[1, 2, 3], [4]], [[5, 5, 6], []]
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7
        )
    ] * 2
    expected = _numpy_penalties(logits, prompts, outputs, [0.7] * 2, [0.5] * 2, [1.3] * 2)
    got = sample_jit(logits, _rows(params, prompts=prompts, outputs=outputs)).sampled_token_ids
    np.testing.assert_array_equal(got, expected.argmax(-1))


def test_top_k_1_equals_greedy():
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(8)]
    np.testing.assert_array_equal(
        sample_jit(logits, _rows(params)).sampled_token_ids, logits.argmax(-1)
    )


def test_temperature_sampling_matches_softmax_frequencies():
    # One request, N draws: row i is the same request after i generated tokens.
    row = np.array([1.0, 0.5, 0.0, -1.0] + [-1e9] * (V - 4), np.float32)
    n, temp = 4000, 0.7
    params = [SamplingParams(temperature=temp, seed=1234)] * n
    tokens = np.asarray(
        sample_jit(np.tile(row, (n, 1)), _rows(params, steps=list(range(n)))).sampled_token_ids
    )
    p = np.exp(row[:4] / temp) / np.exp(row[:4] / temp).sum()
    counts = np.bincount(tokens, minlength=V)
    assert counts[4:].sum() == 0
    chi2 = ((counts[:4] - p * n) ** 2 / (p * n)).sum()
    assert chi2 < 25.0, (counts[:4], p * n)  # df = 3; p(chi2 > 25) ~ 2e-5


def test_sampling_never_picks_masked_tokens():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-30] * (V - 4), np.float32))
    n = 512
    for kw in (dict(top_p=0.7), dict(top_k=2), dict(min_p=0.5)):
        params = [SamplingParams(temperature=1.0, seed=7, **kw)] * n
        tokens = np.asarray(
            sample_jit(np.tile(row, (n, 1)), _rows(params, steps=list(range(n)))).sampled_token_ids
        )
        assert set(tokens.tolist()) == {0, 1}, kw


def test_penalties_match_numpy():
    logits = _logits(3, seed=5)
    prompts = [[0, 1, 2, 2], [3], []]
    outputs = [[2, 4, 4, 4], [], [0, 31, 31]]
    pres, freq, rep = [0.5, 0.0, -1.0], [0.25, 1.0, 2.0], [1.5, 0.8, 1.0]
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
        for p, f, r in zip(pres, freq, rep)
    ]
    expected = _numpy_penalties(logits, prompts, outputs, pres, freq, rep)
    scales = (
        jnp.array(pres, jnp.float32),
        jnp.array(freq, jnp.float32),
        jnp.array(rep, jnp.float32),
    )
    r = _rows(params, prompts=prompts, outputs=outputs)
    history = r.state.history[r.slots]
    num_prompt = jnp.array([len(p) for p in prompts], jnp.int32)
    none = jnp.full((3, 0), PAD_TOKEN_ID, jnp.int32)
    got = apply_penalties(
        jnp.asarray(logits), history, num_prompt, r.num_history_tokens, none, *scales
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
    # The last outputs as drafts after the history (a scored position of speculative decoding):
    # the same; stale history entries past each row's count are ignored.
    cut = [o[:-2] for o in outputs]
    r = _rows(params, prompts=prompts, outputs=cut)
    history = np.array(r.state.history[r.slots])
    history[0, 8], history[1, 1] = 4, 3  # stale, past each row's history
    extra = np.full((3, 2), PAD_TOKEN_ID, np.int32)
    for i, o in enumerate(outputs):
        tail = o[len(cut[i]) :]
        extra[i, : len(tail)] = tail
    got = apply_penalties(
        jnp.asarray(logits), history, num_prompt, r.num_history_tokens, extra, *scales
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


def test_allowed_token_ids_and_logit_bias():
    """vLLM's order: the allow-list masks first, the bias is added, then min_tokens' bans and
    penalties; rows without a list or bias are unchanged; logprobs stay raw."""
    logits = _logits(4, seed=6)
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 7, 30]),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0, 6: -1e9}),  # clamped to -100
        SamplingParams(
            temperature=0.0, allowed_token_ids=[1, 2], logit_bias={2: -50.0}, logprobs=1
        ),
        SamplingParams(temperature=0.0),
    ]
    r = _rows(params)
    bias = np.asarray(r.state.bias)
    assert np.isneginf(bias[0]).sum() == V - 3 and bias[1, 5] == 100.0 and bias[1, 6] == -100.0
    assert bias[2, 1] == 0.0 and bias[2, 2] == -50.0 and not bias[3].any()
    out = sample_jit(jnp.asarray(logits), r)
    want = [[3, 7, 30][int(np.argmax(logits[0, [3, 7, 30]]))], 5, 1, int(np.argmax(logits[3]))]
    assert want[0] != int(np.argmax(logits[0])) and want[3] not in (1, 5)  # the lists matter
    assert np.asarray(out.sampled_token_ids).tolist() == want
    raw = jax.nn.log_softmax(jnp.asarray(logits[2]))
    np.testing.assert_allclose(float(out.logprobs[2, 0]), float(raw[1]), rtol=1e-5)


@pytest.mark.parametrize("extra", [dict(top_p=0.9), dict()])
def test_seeded_request_is_batch_invariant(extra):
    # With extra={}, the request alone skips top-k/top-p (no row truncates) while the batch
    # applies it (row 2 has top_k): the neutral top_k=0 / top_p=1 must then change nothing.
    target = SamplingParams(temperature=1.0, seed=42, **extra)
    logits_row = _logits(1, seed=9)[0]
    others = _logits(5, seed=10)
    for step in range(4):
        alone = sample_jit(logits_row[None], _rows([target], steps=[step])).sampled_token_ids
        # Same request at row 3 of a batch of 5 with different params, seeds and counters.
        params = [
            SamplingParams(temperature=0.8, seed=1),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.2, top_k=5),
            target,
            SamplingParams(temperature=1.0),
        ]
        batch_logits = others.copy()
        batch_logits[3] = logits_row
        r = _rows(params, steps=[7, 3, 1, step, 0], num_rows=8, seeds=[1, 0, 99, 42, 5])
        in_batch = sample_jit(np.concatenate([batch_logits, np.zeros((3, V), np.float32)]), r)
        assert int(in_batch.sampled_token_ids[3]) == int(alone[0]), step
    # Different steps give different draws (not a constant stream).
    draws = {
        int(
            sample_jit(np.zeros((1, V), np.float32), _rows([target], steps=[s])).sampled_token_ids[
                0
            ]
        )
        for s in range(16)
    }
    assert len(draws) > 4


def test_logprobs_and_ranks():
    logits = _logits(4, seed=2)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=100.0),
        SamplingParams(temperature=1.0, seed=3, logprobs=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    # Row 0's penalty changes the sampled token but logprobs stay raw (vLLM "raw_logprobs").
    r = _rows(params, prompts=[[int(logits[0].argmax())], [], [], []])
    out = sample_jit(logits, r)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    ids = np.asarray(out.sampled_token_ids)
    assert ids[0] != logits[0].argmax()  # the repetition penalty moved the greedy choice
    assert out.logprobs.shape == (4, K + 1) and out.logprob_token_ids.shape == (4, K + 1)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], ids)
    np.testing.assert_allclose(out.logprobs[:, 0], ref[np.arange(4), ids], rtol=1e-5, atol=1e-6)
    order = np.argsort(-ref, axis=-1)[:, :K]
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:], order)
    np.testing.assert_allclose(
        out.logprobs[:, 1:], np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-6
    )
    expected_rank = (ref >= ref[np.arange(4), ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.sampled_rank, expected_rank)
    assert int(out.sampled_rank[0]) == 2 and int(out.sampled_rank[2]) == 1
    # No row asks: nothing is computed (zeros), the tokens are the same.
    quiet = sample_jit(logits, _rows([SamplingParams(temperature=0.0)] * 4))
    assert not np.asarray(quiet.logprobs).any() and not np.asarray(quiet.sampled_rank).any()


def test_min_tokens_bans_stop_ids_and_eos():
    logits = np.zeros((3, V), np.float32)
    logits[:, 5] = 10.0  # EOS is by far the most likely
    logits[:, 6] = 9.0  # a stop id
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])] * 2 + [
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    ]
    r = _rows(params, steps=[1, 2, 0], eos_token_id=5)
    assert np.flatnonzero(np.asarray(r.state.stop_mask[0])).tolist() == [5, 6]
    assert not np.asarray(r.state.stop_mask[2]).any()  # ignore_eos: EOS is not a stop
    out = np.asarray(sample_jit(logits, r).sampled_token_ids).tolist()
    assert out[0] not in (5, 6) and out[1] == 5 and out[2] == 5


def test_bad_words_are_read_from_the_slots_history():
    """A word's last token is banned when the latest outputs equal the rest of it (drafts
    before a scored position count as the latest outputs); one-token words always; prompts
    never count."""
    words = [[5], [7, 8, 9], [3, 4]]
    params = [
        SamplingParams(temperature=0.0, bad_words_token_ids=words),
        SamplingParams(temperature=0.0),
    ]
    r = _rows(params, prompts=[[7, 8], [1]], outputs=[[7, 8], [7, 8]])
    state = r.state
    assert state.bad_words[0, 1, -3:].tolist() == [7, 8, 9] and state.bad_words[
        0, 0, -2:
    ].tolist() == [-1, 5]
    assert (np.asarray(state.bad_words[1]) == PAD_TOKEN_ID).all()
    num_prompt = state.num_prompt_tokens[r.slots]
    latest = latest_outputs(
        state.history, r.slots, num_prompt, r.num_history_tokens, jnp.full((2, 0), -1, jnp.int32), 4
    )
    # row 1 has neither bad words nor penalties: its history is never written (nothing reads it)
    assert np.asarray(latest).tolist() == [[-1, -1, 7, 8], [-1, -1, -1, -1]]
    bans = np.asarray(bad_word_bans(state.bad_words[r.slots][:, :, -5:], latest)).tolist()
    assert bans[0][:3] == [5, 9, -1]
    # A draft 3 after the history is the latest output: [7, 8, 9] no longer matches, [3, 4] does.
    latest = latest_outputs(
        state.history,
        r.slots,
        num_prompt,
        r.num_history_tokens,
        jnp.array([[3], [-1]], jnp.int32),
        4,
    )
    assert np.asarray(latest).tolist()[0] == [-1, 7, 8, 3]
    # Fewer outputs than the prefix: the prompt's [7, 8] does not count (vLLM: outputs only).
    r = _rows(params[:1], prompts=[[7, 8]], outputs=[[8]])
    latest = latest_outputs(
        r.state.history,
        r.slots,
        r.state.num_prompt_tokens[r.slots],
        r.num_history_tokens,
        jnp.full((1, 0), -1, jnp.int32),
        4,
    )
    assert np.asarray(latest).tolist() == [[-1, -1, -1, 8]]


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=5),
    outputs=st.lists(st.integers(0, 3), max_size=7),
    drafted=st.integers(0, 2),
)
def test_bad_word_bans_follow_vllms_rule(words, outputs, drafted):
    """Against vLLM's rule written out: a word's last token is banned iff the outputs end with
    the rest of it; the prompt (same tokens) never counts; the newest ``drafted`` outputs may be
    drafts after the history instead of history."""
    want = {
        w[-1]
        for w in words
        if len(w) - 1 <= len(outputs)
        and (len(w) == 1 or outputs[len(outputs) - len(w) + 1 :] == w[:-1])
    }
    drafted = min(drafted, len(outputs))
    known, tail = outputs[: len(outputs) - drafted], outputs[len(outputs) - drafted :]
    prompt = [0, 1, 2, 3, 0, 1, 2, 3]
    r = _rows(
        [SamplingParams(bad_words_token_ids=words)],
        prompts=[prompt],
        outputs=[known],
        vocab=8,
        prior_drafts=[tail + [-1] * (2 - len(tail))],
    )
    s = r.state
    latest = latest_outputs(
        s.history,
        r.slots,
        s.num_prompt_tokens[r.slots],
        r.num_history_tokens,
        r.prior_drafts,
        s.bad_words.shape[2] - 1,
    )
    got = bad_word_bans(s.bad_words[r.slots], latest)
    assert set(np.asarray(got)[0].tolist()) - {-1} == want


def test_sampler_applies_bad_words_greedy_and_when_sampling():
    logits = np.zeros((3, V), np.float32)
    logits[:, 9] = 50.0  # by far the most likely
    logits[:, 11] = 40.0
    words = [[7, 8, 9]]
    params = [
        SamplingParams(temperature=0.0, bad_words_token_ids=words),
        SamplingParams(temperature=0.0, bad_words_token_ids=words),
        SamplingParams(temperature=1.0, seed=0, bad_words_token_ids=words),
    ]
    r = _rows(params, outputs=[[7, 8], [8, 7], [7, 8]])
    assert np.asarray(sample_jit(logits, r).sampled_token_ids).tolist() == [11, 9, 11]


def test_neutral_slots_and_padding_rows_change_nothing():
    """A batch where one row uses every option: the others (neutral options, and padding rows
    reading the neutral slot) sample exactly the argmax."""
    logits = _logits(6, seed=11)
    busy = SamplingParams(
        temperature=0.9,
        top_k=4,
        top_p=0.8,
        min_p=0.05,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={3: 5.0},
        allowed_token_ids=list(range(20)),
        min_tokens=3,
        stop_token_ids=[2],
        bad_words_token_ids=[[4, 5]],
        logprobs=2,
        seed=5,
    )
    params = [SamplingParams(temperature=0.0), busy, SamplingParams(temperature=0.0)]
    r = _rows(
        params, prompts=[[1, 2], [3, 4, 4], [5]], outputs=[[6], [4], []], num_rows=6, eos_token_id=1
    )
    out = np.asarray(sample_jit(logits, r).sampled_token_ids)
    np.testing.assert_array_equal(out[[0, 2, 3, 4, 5]], logits.argmax(-1)[[0, 2, 3, 4, 5]])
    assert out[1] < 20 and out[1] not in (1, 2, 5)
    neutral = r.state.neutral_slot
    assert (
        float(r.state.temperature[neutral]) == 0.0 and not np.asarray(r.state.bias[neutral]).any()
    )


def test_greedy_vocab_major_equals_argmax_on_transposed_logits():
    """The greedy program takes the logits [V, S] (the LM head as W @ h^T): the same tokens as
    ``sample`` of greedy rows on [S, V], with ties, -inf rows and NaNs."""
    rng = np.random.default_rng(3)
    for vocab in (V, 640):  # the plain argmax and the chunked one
        x = rng.integers(-3, 3, size=(8, vocab)).astype(np.float32)  # many ties
        x[1] = -np.inf
        x[2, [5, 9]] = np.nan
        want = np.asarray(
            jax.jit(functools.partial(sample, num_logprobs=0))(
                jnp.asarray(x), _rows([SamplingParams(temperature=0.0)] * 8, vocab=vocab)
            ).sampled_token_ids
        )
        got = np.asarray(jax.jit(sample_greedy_vocab_major)(jnp.asarray(x.T)))
        np.testing.assert_array_equal(got, want)
        assert want[2] == 5


def test_slot_history_and_entries_in_chunks():
    """A long prompt's history and an allow-list larger than one update: several updates of
    the same fixed size, applied in order, write the same slot."""
    prompt = list(range(1, 31)) * 2  # 60 history entries
    params = [SamplingParams(repetition_penalty=1.5, allowed_token_ids=list(range(0, V, 2)))]
    state = write_state(params, prompts=[prompt], outputs=[[7]], entries=8)
    assert np.asarray(state.history[0, :61]).tolist() == prompt + [7]
    assert (
        np.isneginf(np.asarray(state.bias[0, 1::2])).all()
        and not np.asarray(state.bias[0, 0::2]).any()
    )
    assert int(state.num_prompt_tokens[0]) == 60


def test_top_p_top_k_min_p_literal_masks():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 5, jnp.float32))
    # mass before each sorted token: [0, .5, .8, .95]
    out = apply_top_k_top_p(
        logits,
        top_k=jnp.array([0, 0, 0, 3, 3], jnp.int32),
        # row 3: over the top 3, probs renormalise to [.526, .316, .158] -> mass before the
        # third is .842 < .9 (kept); row 4: .842 >= .8 (dropped).
        top_p=jnp.array([0.7, 0.85, 1.0, 0.9, 0.8], jnp.float32),
    )
    kept = np.isfinite(np.asarray(out))
    assert kept.tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
        [True, True, True, False],
        [True, True, False, False],
    ]
    np.testing.assert_array_equal(np.asarray(out)[kept], np.asarray(logits)[kept])
    # Neutral top_k / top_p keep a tail whose float32 mass rounds to nothing.
    tail = jnp.array([[0.0, -30.0, -40.0, -50.0]], jnp.float32)
    out = apply_top_k_top_p(tail, jnp.array([0], jnp.int32), jnp.array([1.0], jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tail))
    # min_p: keep p >= min_p * p_max = min_p * 0.5.
    out = apply_min_p(logits[:3], jnp.array([0.0, 0.2, 0.5], jnp.float32))
    assert np.isfinite(np.asarray(out)).tolist() == [
        [True, True, True, True],
        [True, True, True, False],  # 0.05 < 0.1
        [True, True, False, False],  # 0.15 < 0.25
    ]


def _numpy_penalties(logits, prompts, outputs, presence, frequency, repetition):
    out = np.array(logits, np.float64)
    for i in range(out.shape[0]):
        counts = np.bincount(np.asarray(outputs[i], np.int64), minlength=out.shape[1])
        seen = (np.bincount(np.asarray(prompts[i], np.int64), minlength=out.shape[1]) > 0) | (
            counts > 0
        )
        pos = out[i] > 0
        out[i] = np.where(
            seen & pos, out[i] / repetition[i], np.where(seen, out[i] * repetition[i], out[i])
        )
        out[i] -= frequency[i] * counts + presence[i] * (counts > 0)
    return out.astype(np.float32)


def test_prompt_logprobs_helper():
    logits = _logits(5, seed=4)  # 5 prompt positions
    targets = np.array([3, 0, 31, 7, 7], np.int32)
    lp, rank, top_ids, top_lp = jax.jit(compute_logprobs, static_argnames="num_logprobs")(
        logits, targets, num_logprobs=2
    )
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(lp, ref[np.arange(5), targets], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rank, (ref >= ref[np.arange(5), targets][:, None]).sum(-1))
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, -1)[:, :2])
    assert top_lp.shape == (5, 2)


def test_request_keys():
    for seed in (0, 7, 2**32 - 1):
        np.testing.assert_array_equal(
            make_request_key(seed), jax.random.key_data(jax.random.PRNGKey(seed))
        )
    assert make_request_key(2**40 + 3).tolist() == [2**8, 3]
    a, b = make_unseeded_request_key(0, "req-1"), make_unseeded_request_key(0, "req-2")
    assert a.dtype == np.uint32 and a.tolist() != b.tolist()
    np.testing.assert_array_equal(a, make_unseeded_request_key(0, "req-1"))
    assert make_unseeded_request_key(1, "req-1").tolist() != a.tolist()
