"""Sampler: greedy exactness, truncation masks, penalties, per-request seeds, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.sampler import (
    apply_min_p,
    argmax,
    apply_penalties,
    apply_top_k_top_p,
    bad_word_bans,
    compute_logprobs,
    sample,
    sample_greedy_vocab_major,
)
from jaxkv.worker.sampling_metadata import build_sampling_metadata, make_request_key, make_unseeded_request_key

sample_jit = jax.jit(sample)
V = 32


def _md(params, *, steps=None, prompts=None, outputs=None, num_rows=None, seeds=None, **kw):
    n = len(params)
    keys = np.stack([make_request_key(s) for s in (seeds or [p.seed or 0 for p in params])])
    prompts = prompts if prompts is not None else [[]] * n
    outputs = outputs if outputs is not None else [[]] * n
    return build_sampling_metadata(
        params, keys, steps if steps is not None else [0] * n,
        [list(p) + list(o) for p, o in zip(prompts, outputs)], [len(p) for p in prompts],
        num_rows=num_rows or n, vocab_size=V, **kw,
    )


def _logits(rows, seed=0):
    return np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (rows, V)) * 3, np.float32)


def test_argmax_equals_numpy_first_max_with_ties_inf_and_nan():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(64, 40)).astype(np.float32)  # many ties
    x[1] = -np.inf                                             # all -inf -> 0
    x[2, [5, 9]] = np.nan                                      # first NaN wins (numpy rule)
    x[3, [7, 30]] = np.inf
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[1] == 0 and got[2] == 5 and got[3] == 7
    assert got.dtype == np.int32


@pytest.mark.parametrize("vocab", [640, 1024, 32000])
def test_chunked_argmax_equals_numpy_first_max(vocab):
    """Vocabularies with a divisor in [64, 512] take the chunked path: the first chunk holding
    the maximum (or a NaN) is searched, so ties across chunks and NaNs in later chunks count."""
    from jaxkv.worker.sampler import _argmax_chunk

    c = _argmax_chunk(vocab)
    assert c is not None and vocab % c == 0 and vocab // c > 1
    rng = np.random.default_rng(vocab)
    x = rng.integers(-40, 3, size=(16, vocab)).astype(np.float32)   # ties within and across chunks
    x[1] = -np.inf                                                   # all -inf -> 0
    x[2, [vocab - 1, c + 3]] = np.nan                                # first NaN, not in chunk 0
    x[3, [vocab - 2, 5]] = np.inf
    x[4] = 0.0
    x[4, [c - 1, c, vocab - 1]] = 1.0                                # tie at a chunk boundary
    x[5, vocab - 1] = 9.0                                            # max in the last chunk
    x[6] = rng.standard_normal(vocab)
    x[6, 2 * c - 1] = np.nan                                         # NaN beats a larger max
    x[6, 0] = 100.0
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[2] == c + 3 and got[4] == c - 1 and got[5] == vocab - 1 and got[6] == 2 * c - 1
    # Along axis 0 ([V, S]) the same tokens, and the fast path agrees once no NaN / inf sends
    # the batch to the exact path.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: argmax(v, axis=0))(x.T)), got)
    finite = np.nan_to_num(x, nan=0.0, posinf=50.0, neginf=-50.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(finite)), np.argmax(finite, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: argmax(v, axis=0))(finite.T)),
                                  np.argmax(finite, axis=-1))


def test_greedy_is_argmax_also_in_mixed_batch():
    logits = _logits(6)
    out = sample_jit(logits, _md([SamplingParams(temperature=0.0)] * 5, num_rows=6))
    np.testing.assert_array_equal(out.sampled_token_ids, logits.argmax(-1))
    # Mixed: rows 0, 2, 4 greedy, the others random; greedy rows are still the exact argmax.
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, seed=i) for i in range(6)]
    md = _md(params)
    assert not md.all_greedy
    out = np.asarray(sample_jit(logits, md).sampled_token_ids)
    np.testing.assert_array_equal(out[::2], logits.argmax(-1)[::2])


def test_greedy_is_argmax_of_penalised_logits():
    logits = _logits(2, seed=3)
    prompts, outputs = [[1, 2, 3], [4]], [[5, 5, 6], []]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=0.7)] * 2
    md = _md(params, prompts=prompts, outputs=outputs)
    expected = _numpy_penalties(logits, prompts, outputs, [0.7] * 2, [0.5] * 2, [1.3] * 2)
    np.testing.assert_array_equal(sample_jit(logits, md).sampled_token_ids, expected.argmax(-1))


def test_top_k_1_equals_greedy():
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(8)]
    md = _md(params)
    assert md.use_top_k_top_p and not md.all_greedy
    np.testing.assert_array_equal(sample_jit(logits, md).sampled_token_ids, logits.argmax(-1))


def test_temperature_sampling_matches_softmax_frequencies():
    # One request, N draws: row i is the same request after i generated tokens.
    row = np.array([1.0, 0.5, 0.0, -1.0], np.float32)
    n, temp = 4000, 0.7
    params = [SamplingParams(temperature=temp, seed=1234)] * n
    md = _md(params, steps=list(range(n)))
    tokens = np.asarray(sample_jit(np.tile(row, (n, 1)), md).sampled_token_ids)
    expected = np.exp(row / temp) / np.exp(row / temp).sum() * n
    counts = np.bincount(tokens, minlength=4)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 25.0, (counts, expected)  # df = 3; p(chi2 > 25) ~ 2e-5


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


def test_sampling_never_picks_masked_tokens():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    n = 512
    cases = [dict(top_p=0.7), dict(top_k=2), dict(min_p=0.5)]
    for kw in cases:
        md = _md([SamplingParams(temperature=1.0, seed=7, **kw)] * n, steps=list(range(n)))
        tokens = np.asarray(sample_jit(np.tile(row, (n, 1)), md).sampled_token_ids)
        assert set(tokens.tolist()) == {0, 1}, kw


def _numpy_penalties(logits, prompts, outputs, presence, frequency, repetition):
    out = np.array(logits, np.float64)
    for i in range(out.shape[0]):
        counts = np.bincount(np.asarray(outputs[i], np.int64), minlength=out.shape[1])
        seen = (np.bincount(np.asarray(prompts[i], np.int64), minlength=out.shape[1]) > 0) | (counts > 0)
        pos = out[i] > 0
        out[i] = np.where(seen & pos, out[i] / repetition[i], np.where(seen, out[i] * repetition[i], out[i]))
        out[i] -= frequency[i] * counts + presence[i] * (counts > 0)
    return out.astype(np.float32)


def test_penalties_match_numpy():
    logits = _logits(3, seed=5)
    prompts = [[0, 1, 2, 2], [3], []]
    outputs = [[2, 4, 4, 4], [], [0, 31, 31]]
    pres, freq, rep = [0.5, 0.0, -1.0], [0.25, 1.0, 2.0], [1.5, 0.8, 1.0]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
              for p, f, r in zip(pres, freq, rep)]
    expected = _numpy_penalties(logits, prompts, outputs, pres, freq, rep)
    scales = (jnp.array(pres, jnp.float32), jnp.array(freq, jnp.float32), jnp.array(rep, jnp.float32))
    md = _md(params, prompts=prompts, outputs=outputs)
    assert md.use_penalties
    got = apply_penalties(jnp.asarray(logits), md.history_token_ids, md.num_prompt_tokens,
                          md.num_history_tokens, md.pending_token_ids, *scales)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
    # The last output token still in flight (async): left out of the history, passed as the
    # pending token; stale entries past num_history_tokens are ignored.
    md = _md(params, prompts=prompts, outputs=[o[:-1] for o in outputs])
    history = np.array(md.history_token_ids)
    history[0, 7], history[1, 1] = 4, 3     # stale, past each row's history
    pending = np.array([o[-1] if o else -1 for o in outputs], np.int32)
    got = apply_penalties(jnp.asarray(logits), history, md.num_prompt_tokens,
                          md.num_history_tokens, pending, *scales)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


def test_allowed_token_ids_and_logit_bias():
    """vLLM's order: the allow-list masks first, the bias is added, then min_tokens' bans and
    penalties; rows without a list or bias are unchanged; logprobs stay raw."""
    logits = _logits(4, seed=6)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[3, 7, 30]),
              SamplingParams(temperature=0.0, logit_bias={5: 100.0, 6: -1e9}),   # clamped to -100
              SamplingParams(temperature=0.0, allowed_token_ids=[1, 2], logit_bias={2: -50.0},
                             logprobs=1),
              SamplingParams(temperature=0.0)]
    md = _md(params)
    assert md.allowed_token_ids.shape == (4, 4) and md.bias_token_ids.shape == (4, 4)
    out = sample_jit(jnp.asarray(logits), md)
    want = [[3, 7, 30][int(np.argmax(logits[0, [3, 7, 30]]))], 5, 1, int(np.argmax(logits[3]))]
    assert want[0] != int(np.argmax(logits[0])) and want[3] not in (1, 5)   # the lists matter
    assert np.asarray(out.sampled_token_ids).tolist() == want
    raw = jax.nn.log_softmax(jnp.asarray(logits[2]))
    np.testing.assert_allclose(float(out.logprobs[2, 0]), float(raw[1]), rtol=1e-5)
    assert _md([SamplingParams()]).allowed_token_ids.shape == (1, 0)   # no list: no work


@pytest.mark.parametrize("extra", [dict(top_p=0.9), dict()])
def test_seeded_request_is_batch_invariant(extra):
    # With extra={}, the request alone skips top-k/top-p (static flag off) while the batch
    # applies it (row 2 has top_k): the neutral top_k=0 / top_p=1 must then change nothing.
    target = SamplingParams(temperature=1.0, seed=42, **extra)
    logits_row = _logits(1, seed=9)[0]
    others = _logits(5, seed=10)
    for step in range(4):
        alone = sample_jit(logits_row[None], _md([target], steps=[step])).sampled_token_ids
        # Same request at row 3 of a batch of 5 with different params, seeds and counters.
        params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.2, top_k=5), target, SamplingParams(temperature=1.0)]
        batch_logits = others.copy()
        batch_logits[3] = logits_row
        md = _md(params, steps=[7, 3, 1, step, 0], num_rows=8,
                 seeds=[1, 0, 99, 42, 5])
        in_batch = sample_jit(np.concatenate([batch_logits, np.zeros((3, V), np.float32)]), md)
        assert int(in_batch.sampled_token_ids[3]) == int(alone[0]), step
    # Different steps give different draws (not a constant stream).
    draws = {int(sample_jit(np.zeros((1, V), np.float32), _md([target], steps=[s])).sampled_token_ids[0])
             for s in range(16)}
    assert len(draws) > 4


def test_logprobs_and_ranks():
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=100.0),
              SamplingParams(temperature=1.0, seed=3, logprobs=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)]
    # Row 0's penalty changes the sampled token but logprobs stay raw (vLLM "raw_logprobs").
    md = _md(params, prompts=[[int(logits[0].argmax())], [], [], []], outputs=[[]] * 4)
    assert md.max_num_logprobs == 4  # max K = 3, bucketed to a power of two
    out = sample_jit(logits, md)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    ids = np.asarray(out.sampled_token_ids)
    assert ids[0] != logits[0].argmax()  # the repetition penalty moved the greedy choice
    assert out.logprobs.shape == (4, 5) and out.logprob_token_ids.shape == (4, 5)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], ids)
    np.testing.assert_allclose(out.logprobs[:, 0], ref[np.arange(4), ids], rtol=1e-5, atol=1e-6)
    order = np.argsort(-ref, axis=-1)[:, :4]
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:], order)
    np.testing.assert_allclose(out.logprobs[:, 1:], np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-6)
    expected_rank = (ref >= ref[np.arange(4), ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.sampled_rank, expected_rank)
    assert int(out.sampled_rank[0]) == 2 and int(out.sampled_rank[2]) == 1


def test_prompt_logprobs_helper():
    logits = _logits(5, seed=4)  # 5 prompt positions
    targets = np.array([3, 0, 31, 7, 7], np.int32)
    lp, rank, top_ids, top_lp = jax.jit(compute_logprobs, static_argnames="num_logprobs")(
        logits, targets, num_logprobs=2)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(lp, ref[np.arange(5), targets], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rank, (ref >= ref[np.arange(5), targets][:, None]).sum(-1))
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, -1)[:, :2])
    assert top_lp.shape == (5, 2)


def test_min_tokens_bans_stop_ids_and_eos():
    logits = np.zeros((2, V), np.float32)
    logits[:, 5] = 10.0   # EOS is by far the most likely
    logits[:, 6] = 9.0    # a stop id
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])] * 2
    md = _md(params, steps=[1, 2], eos_token_id=5)
    assert md.banned_token_ids.tolist() == [[6, 5, -1, -1], [-1, -1, -1, -1]]
    out = sample_jit(logits, md).sampled_token_ids
    assert np.asarray(out).tolist()[1] == 5 and np.asarray(out).tolist()[0] not in (5, 6)


def test_bad_words_metadata_and_bans():
    """A word's last token is banned when the latest outputs (host tail, then the pending token
    under async scheduling) equal the rest of it; one-token words always; prompts never count."""
    words = [[5], [7, 8, 9], [3, 4]]
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=words), SamplingParams(temperature=0.0)]
    md = _md(params, prompts=[[7, 8], [1]], outputs=[[7, 8], [7, 8]])
    assert md.bad_word_last_ids.tolist() == [[5, 9, 4, -1], [-1] * 4]
    assert md.bad_word_prefix_ids.shape == (2, 4, 4)
    assert md.bad_word_prefix_ids[0].tolist() == [[-1] * 4, [-1, -1, 7, 8], [-1, -1, -1, 3], [-1] * 4]
    assert md.recent_output_ids.tolist() == [[-1, -1, 7, 8], [-1] * 4]   # row 1 has no words
    assert md.reads_pending and not md.use_penalties
    bans = jax.jit(bad_word_bans)
    args = (md.bad_word_prefix_ids, md.bad_word_last_ids, md.recent_output_ids)
    assert np.asarray(bans(*args, np.array([-1, -1], np.int32))).tolist() == [[5, 9, -1, -1], [-1] * 4]
    # A pending 3 is the latest output: [7, 8, 9] no longer matches, [3, 4] does.
    assert np.asarray(bans(*args, np.array([3, -1], np.int32))).tolist() == [[5, -1, 4, -1], [-1] * 4]
    # Fewer outputs than the prefix: the prompt's [7, 8] does not count (vLLM: outputs only).
    md = _md(params[:1], prompts=[[7, 8]], outputs=[[8]])
    assert md.recent_output_ids.tolist() == [[-1, -1, -1, 8]]
    assert np.asarray(bans(md.bad_word_prefix_ids, md.bad_word_last_ids, md.recent_output_ids,
                           np.array([-1], np.int32))).tolist() == [[5, -1, -1, -1]]
    # Only one-token words: no tokens needed, nothing pending to read.
    md = build_sampling_metadata([SamplingParams(bad_words_token_ids=[[5], [6]])], np.zeros((1, 2), np.uint32),
                                 [0], num_rows=2)
    assert md.bad_word_prefix_ids.shape == (2, 4, 0) and not md.reads_pending
    with pytest.raises(ValueError, match="bad words need token_ids"):
        build_sampling_metadata(params, np.zeros((2, 2), np.uint32), [0, 0], num_rows=2)


_bans_jit = jax.jit(bad_word_bans)


@settings(max_examples=80, deadline=None)
@given(words=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=5),
       outputs=st.lists(st.integers(0, 3), max_size=7), in_flight=st.booleans())
def test_bad_word_bans_follow_vllms_rule(words, outputs, in_flight):
    """Against vLLM's rule written out: a word's last token is banned iff the outputs end with
    the rest of it; the prompt (same tokens) never counts; under async scheduling the newest
    output is not on the host yet but pending on the device."""
    want = {w[-1] for w in words if len(w) - 1 <= len(outputs)
            and (len(w) == 1 or outputs[len(outputs) - len(w) + 1:] == w[:-1])}
    pending = outputs[-1] if in_flight and outputs else -1
    known = outputs[:-1] if pending >= 0 else outputs
    prompt = [0, 1, 2, 3, 0, 1, 2, 3]
    md = build_sampling_metadata([SamplingParams(bad_words_token_ids=words)], np.zeros((1, 2), np.uint32),
                                 [len(outputs)], [prompt + known], [len(prompt)], num_rows=1)
    got = _bans_jit(md.bad_word_prefix_ids, md.bad_word_last_ids, md.recent_output_ids,
                    np.array([pending], np.int32))
    assert set(np.asarray(got)[0].tolist()) - {-1} == want


def test_sampler_applies_bad_words_on_both_greedy_paths_and_when_sampling():
    logits = np.zeros((3, V), np.float32)
    logits[:, 9] = 50.0   # by far the most likely
    logits[:, 11] = 40.0
    words = [[7, 8, 9]]
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=words),
              SamplingParams(temperature=0.0, bad_words_token_ids=words),
              SamplingParams(temperature=1.0, seed=0, bad_words_token_ids=words)]
    md = _md(params, outputs=[[7, 8], [8, 7], [7, 8]])
    out = np.asarray(sample_jit(logits, md).sampled_token_ids).tolist()
    assert out == [11, 9, 11]
    greedy = _md(params[:2], outputs=[[7, 8], [8, 7]])
    got = jax.jit(sample_greedy_vocab_major)(jnp.asarray(logits[:2].T), greedy).sampled_token_ids
    assert np.asarray(got).tolist() == [11, 9]


def test_metadata_padding_and_static_flags():
    md = _md([SamplingParams(temperature=0.5, top_p=0.9, seed=3)], num_rows=4)
    assert md.temperature.tolist() == [0.5, 0, 0, 0]  # padding rows greedy
    assert md.key_data.tolist() == [[0, 3], [0, 0], [0, 0], [0, 0]]
    assert (md.all_greedy, md.use_penalties, md.use_top_k_top_p, md.max_num_logprobs) == (
        False, False, True, None)
    assert md.history_token_ids.shape == (4, 0)
    md = _md([SamplingParams(frequency_penalty=0.1)], prompts=[[1] * 20], outputs=[[2]], num_rows=2)
    # One history width for prompt and output, a power of two >= 256: few compiled variants.
    assert md.use_penalties and md.history_token_ids.shape == (2, 256)
    assert md.history_token_ids[0, :22].tolist() == [1] * 20 + [2, -1]
    assert (md.num_prompt_tokens.tolist(), md.num_history_tokens.tolist()) == ([20, 0], [21, 0])
    assert md.pending_token_ids.tolist() == [-1, -1]
    md = _md([SamplingParams(frequency_penalty=0.1)], prompts=[[1] * 200], outputs=[[2] * 57])
    assert md.history_token_ids.shape == (1, 512)
    with pytest.raises(ValueError, match="do not fit"):
        _md([SamplingParams()] * 3, num_rows=2)


def test_request_keys():
    for seed in (0, 7, 2**32 - 1):
        np.testing.assert_array_equal(make_request_key(seed), jax.random.key_data(jax.random.PRNGKey(seed)))
    assert make_request_key(2**40 + 3).tolist() == [2**8, 3]
    a, b = make_unseeded_request_key(0, "req-1"), make_unseeded_request_key(0, "req-2")
    assert a.dtype == np.uint32 and a.tolist() != b.tolist()
    np.testing.assert_array_equal(a, make_unseeded_request_key(0, "req-1"))
    assert make_unseeded_request_key(1, "req-1").tolist() != a.tolist()


def test_greedy_vocab_major_equals_sample_on_transposed_logits():
    """The step's all-greedy path takes the logits [V, S] (the LM head as W @ h^T): the same
    tokens as ``sample`` on [S, V], with min_tokens' banned ids, ties, -inf rows and NaNs."""
    rng = np.random.default_rng(3)
    for vocab in (V, 640):  # the plain argmax and the chunked one
        x = rng.integers(-3, 3, size=(8, vocab)).astype(np.float32)   # many ties
        x[1] = -np.inf
        x[2, [5, 9]] = np.nan
        x[3, [4, 6]] = 100.0                                           # 4 and 6 are banned below
        params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])] * 8
        md = build_sampling_metadata(params, np.zeros((8, 2), np.uint32), [0] * 8, [[]] * 8,
                                     [0] * 8, num_rows=8, vocab_size=vocab, eos_token_id=4)
        assert md.banned_token_ids.shape[1] > 0
        want = np.asarray(sample_jit(jnp.asarray(x), md).sampled_token_ids)
        got = np.asarray(jax.jit(sample_greedy_vocab_major)(jnp.asarray(x.T), md).sampled_token_ids)
        np.testing.assert_array_equal(got, want)
        assert want[3] not in (4, 6) and want[2] == 5


def test_greedy_vocab_major_refuses_sampling_metadata():
    md = _md([SamplingParams(temperature=0.7, seed=1)])
    with pytest.raises(ValueError, match="all-greedy"):
        sample_greedy_vocab_major(jnp.zeros((V, 1)), md)
    md = _md([SamplingParams(temperature=0.0, logprobs=2)])
    with pytest.raises(ValueError, match="all-greedy"):
        sample_greedy_vocab_major(jnp.zeros((V, 1)), md)
