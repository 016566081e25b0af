"""Requests the step could only fail on are refused up front, and every EOS id stops.

Each refusal is a ValueError/TypeError naming the field and the value, raised by
``SamplingParams`` (values wrong for any model) or ``LLMEngine.add_request`` (values wrong for
this model: the vocabulary, ``max_logprobs``), and leaves the engine as it was: a normal
generate afterwards gives the dense reference's tokens and frees every block. The engine's
model lists several EOS ids (Llama 3 style), with the tokenizer's in front; greedy decoding
emits the last of them, so it must stop there.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM, BeamSearchParams, SamplingParams
from jaxkv.core import SchedulerConfig
from jaxkv.core.stop_check import with_eos_stop_ids
from jaxkv.engine_config import resolve_engine_config
from jaxkv.models import dense_forward
from jaxkv.sampling_params import resolve_logprobs
from tests.engine.helpers import assert_no_block_leaks, dense_greedy, make_llm, small_model
from tests.worker.sampler_helpers import write_state

PROMPT = [3, 14, 15, 92, 65, 35]
OTHER = [7, 8, 9, 10]
VOCAB = 512  # small_model's


class _CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26); its EOS id is set per engine."""

    bos_token_id = None
    chat_template = None

    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) - ord("a") for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def greedy():
    """Dense greedy tokens of PROMPT and OTHER (the model without EOS: same weights)."""
    model = small_model()
    return {"prompt": dense_greedy(model, PROMPT, 10), "other": dense_greedy(model, OTHER, 4)}


@pytest.fixture(scope="module")
def eos_ids(greedy):
    """(tokenizer EOS, config EOS 1, config EOS 2): greedy decoding of PROMPT never emits the
    first two and emits the third first at output ``stop_at`` >= 2."""
    out = greedy["prompt"]
    stop_at = next(j for j in range(2, len(out)) if out[j] not in out[:j])
    unused = [t for t in range(VOCAB - 1, 0, -1) if t not in out]
    return (unused[0], unused[1], out[stop_at]), stop_at


@pytest.fixture(scope="module")
def model(eos_ids):
    ids, _ = eos_ids
    return small_model(eos_token_id=list(ids[1:]))  # a list, as in config.json; stored as a tuple


@pytest.fixture(scope="module")
def llm(model, eos_ids):
    ids, _ = eos_ids
    return make_llm(model, tokenizer=_CharTokenizer(ids[0]), max_model_len=128)


def _assert_still_usable(llm, greedy):
    """A normal request after a refusal: the dense reference's tokens, every block freed."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate(
        [OTHER], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert out.outputs[0].token_ids == greedy["other"]
    assert engine.get_stats().kv_cache_usage == 0
    assert_no_block_leaks(llm)


# ---- SamplingParams: values wrong for any model ---------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(temperature=1.0, top_k=2**40), ValueError, r"top_k must be .*got 1099511627776"),
        (dict(top_k=2**31), ValueError, "top_k must be"),
        (
            dict(stop_token_ids=[5, 2**40]),
            ValueError,
            r"stop_token_ids must hold token ids .*1099511627776",
        ),
        (dict(logit_bias={2**31: 1.0}), ValueError, "logit_bias needs token ids"),
        (dict(logit_bias={5: math.inf}), ValueError, r"logit_bias needs .*finite.*inf"),
        (dict(logit_bias={5: -math.inf}), ValueError, "logit_bias needs"),
        (dict(logit_bias={5: "1"}), ValueError, "logit_bias needs"),
        (dict(allowed_token_ids=[1, 2**31]), ValueError, "allowed_token_ids must hold token ids"),
        (dict(allowed_token_ids=[True]), ValueError, "allowed_token_ids must hold token ids"),
        (
            dict(bad_words_token_ids=[[1, 2**35]]),
            ValueError,
            "bad_words_token_ids must be non-empty lists of token ids",
        ),
        (dict(seed="x"), ValueError, r"seed must be None or an int .*'x'"),
        (dict(seed=1.0), ValueError, "seed must be"),
        (dict(seed=2**64), ValueError, r"seed must be .*18446744073709551616"),
        (dict(seed=-(2**63) - 1), ValueError, "seed must be"),
        (dict(temperature=math.inf), ValueError, "temperature must be finite"),
        (dict(temperature=1e39), ValueError, r"temperature must be at most .*float32"),
        (dict(repetition_penalty=math.inf), ValueError, "repetition_penalty must be finite"),
        (dict(repetition_penalty=1e39), ValueError, "repetition_penalty must be at most"),
        (dict(stop=["x"], detokenize=False), ValueError, "stop strings .* need detokenize=True"),
    ],
)
def test_sampling_params_refuse_values_the_step_cannot_take(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_token_ids():
    p = SamplingParams(
        stop_token_ids=[np.int64(5)],
        allowed_token_ids=[3, 3, np.int32(4), 3],
        logit_bias={np.int64(7): 1.0},
        bad_words_token_ids=[[np.int64(2)]],
        seed=2**64 - 1,
    )
    assert p.stop_token_ids == [5] and type(p.stop_token_ids[0]) is int
    assert p.allowed_token_ids == [3, 4]  # duplicates dropped: the worker pads to the longest list
    assert list(p.logit_bias) == [7] and type(next(iter(p.logit_bias))) is int
    assert p.bad_words_token_ids == [[2]]
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_min_tokens_beyond_int32_builds_its_bans():
    """Any min_tokens is valid (max_model_len ends the request first); the slot's min_tokens is
    clamped to int32 instead of overflowing the sampling state."""
    state = write_state(
        [SamplingParams(max_tokens=None, min_tokens=2**40, stop_token_ids=[4])], eos_token_id=2
    )
    assert int(state.min_tokens[0]) == 2**31 - 1
    assert np.flatnonzero(np.asarray(state.stop_mask[0])).tolist() == [2, 4]


def test_resolve_logprobs_follows_vllm():
    """-1 is the vocabulary; counts above max_logprobs (-1: the vocabulary) are refused with
    vLLM's message, counts above the vocabulary always; beam search's rounds skip the cap."""
    assert (
        resolve_logprobs(
            SamplingParams(logprobs=-1, prompt_logprobs=-1), vocab_size=VOCAB, max_logprobs=-1
        ).logprobs
        == VOCAB
    )
    p = SamplingParams(logprobs=20)
    assert resolve_logprobs(p, vocab_size=VOCAB, max_logprobs=20) is p
    with pytest.raises(
        ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"
    ):
        resolve_logprobs(SamplingParams(logprobs=21), vocab_size=VOCAB, max_logprobs=20)
    with pytest.raises(
        ValueError, match=f"Requested prompt logprobs of {VOCAB}, .* max allowed: 20"
    ):
        resolve_logprobs(SamplingParams(prompt_logprobs=-1), vocab_size=VOCAB, max_logprobs=20)
    with pytest.raises(
        ValueError, match=f"logprobs=600 is larger than the vocabulary size {VOCAB}"
    ):
        resolve_logprobs(SamplingParams(logprobs=600), vocab_size=VOCAB, max_logprobs=1000)


# ---- add_request: values wrong for this model --------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(temperature=1.0, top_k=VOCAB + 1),
            f"top_k={VOCAB + 1} is larger than the vocabulary size {VOCAB}",
        ),
        (
            dict(stop_token_ids=[1, VOCAB]),
            rf"stop_token_ids has token ids \[{VOCAB}\] outside the vocabulary",
        ),
        (dict(logit_bias={VOCAB + 3: 1.0}), r"logit_bias has token ids \[515\]"),
        (dict(allowed_token_ids=[1, 2**31 - 1]), r"allowed_token_ids has token ids \[2147483647\]"),
        (dict(bad_words_token_ids=[[1, 9000]]), r"bad_words has token ids \[9000\]"),
        (
            dict(logprobs=21),
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            dict(logprobs=-1),
            f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20",
        ),
        (
            dict(prompt_logprobs=-1),
            f"Requested prompt logprobs of {VOCAB}, which is greater than max allowed: 20",
        ),
        (
            dict(logprobs=10**12),
            "Requested sample logprobs of 1000000000000",
        ),  # nothing allocated for it
        (dict(n=3, prompt_logprobs=25), "Requested prompt logprobs of 25"),
    ],
)
def test_add_request_refuses_and_leaves_the_engine_unchanged(llm, greedy, kwargs, match):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=3, **kwargs))
    assert (
        engine.get_num_unfinished_requests() == 0 and not engine.scheduler.has_unfinished_requests()
    )
    with pytest.raises(ValueError, match=match):  # through LLM.generate too
        llm.generate([PROMPT, OTHER], SamplingParams(max_tokens=3, **kwargs), use_tqdm=False)
    _assert_still_usable(llm, greedy)


def test_abort_request_needs_string_ids(llm, greedy):
    engine = llm.llm_engine
    with pytest.raises(TypeError, match="request ids must be str .*got 5"):
        engine.abort_request(5)
    with pytest.raises(TypeError, match=r"request ids must be str, got \[5\]"):
        engine.abort_request(["a", 5])
    engine.abort_request("never-added")  # unknown ids are ignored, as in vLLM
    _assert_still_usable(llm, greedy)


def test_logprobs_within_the_cap_and_wide_seeds_work(llm, greedy):
    """20 logprobs (the default cap) pass; n > 1 with the largest seed wraps its children's
    seeds (seed + i mod 2**64, the sampler's key), so child 1 samples as seed 0 does."""
    (out,) = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=2, temperature=0, logprobs=20, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.outputs[0].token_ids == greedy["prompt"][:2]
    assert all(len(lp) in (20, 21) for lp in out.outputs[0].logprobs)
    sampled = dict(max_tokens=5, temperature=1.0, ignore_eos=True)
    (wide,) = llm.generate([PROMPT], SamplingParams(n=2, seed=2**64 - 1, **sampled), use_tqdm=False)
    (zero,) = llm.generate([PROMPT], SamplingParams(seed=0, **sampled), use_tqdm=False)
    assert wide.outputs[1].token_ids == zero.outputs[0].token_ids
    _assert_still_usable(llm, greedy)


def test_beam_search_wider_than_the_logprobs_cap(llm, greedy):
    """beam_width 11 asks for 22 logprobs a round, above max_logprobs=20: refused as vLLM
    does (the sampler's logprob columns are fixed at compile time), naming the way out; 10
    fits exactly."""
    with pytest.raises(
        ValueError, match="beam_width=11 needs 2 \\* beam_width = 22 .* max_logprobs=20"
    ):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=2, ignore_eos=True))
    (out,) = llm.beam_search(
        [PROMPT], BeamSearchParams(beam_width=10, max_tokens=2, ignore_eos=True)
    )
    assert len(out.sequences) == 10 and len({tuple(s.tokens) for s in out.sequences}) == 10
    with pytest.raises(ValueError, match="2 \\* beam_width <= the vocabulary"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=VOCAB // 2 + 1, max_tokens=1))
    with pytest.raises(ValueError, match="max allowed: 20"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=22), use_tqdm=False)
    _assert_still_usable(llm, greedy)


def test_detokenize_false_returns_no_text(llm, greedy):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    (text,) = llm.generate([PROMPT], params, use_tqdm=False)
    (bare,) = llm.generate([PROMPT], dataclasses.replace(params, detokenize=False), use_tqdm=False)
    assert text.outputs[0].text == _CharTokenizer(None).decode(greedy["prompt"][:3])
    assert bare.outputs[0].text == "" and bare.outputs[0].token_ids == greedy["prompt"][:3]


# ---- several EOS ids ---------------------------------------------------------------------------


def test_every_eos_id_stops_generation(llm, eos_ids, greedy):
    ids, stop_at = eos_ids
    engine = llm.llm_engine
    assert (
        engine.config.eos_token_ids == ids and engine.input_processor.eos_token_id == ids[0]
    )  # tokenizer's first
    user = SamplingParams(max_tokens=10, temperature=0)
    (out,) = llm.generate([PROMPT], user, use_tqdm=False)
    c = out.outputs[0]
    # Before: only the first id stopped, and generation ran on to max_tokens.
    assert c.token_ids == greedy["prompt"][: stop_at + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", ids[2])  # as a stop token id, as in vLLM
    assert user.stop_token_ids == []  # the caller's params untouched
    (free,) = llm.generate([PROMPT], dataclasses.replace(user, ignore_eos=True), use_tqdm=False)
    assert (
        free.outputs[0].token_ids == greedy["prompt"] and free.outputs[0].finish_reason == "length"
    )
    assert_no_block_leaks(llm)


def test_min_tokens_bans_every_eos_id(llm, model, eos_ids):
    """Before min_tokens outputs no EOS id may be sampled (all three are set to -inf, as the
    dense reference does); afterwards the first EOS id stops the request."""
    ids, stop_at = eos_ids
    m = stop_at + 2
    want = dense_greedy(model, PROMPT, 12, banned=lambda out: ids if len(out) < m else ())
    first_eos = next((j for j in range(m, len(want)) if want[j] in ids), None)
    (out,) = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, min_tokens=m, temperature=0), use_tqdm=False
    )
    c = out.outputs[0]
    if first_eos is None:
        assert (c.token_ids, c.finish_reason) == (want, "length")
    else:
        assert (c.token_ids, c.finish_reason) == (want[: first_eos + 1], "stop")
    assert not set(c.token_ids[:m]) & set(ids)
    # the worker's bans: the request's stop token ids (the extra EOS ids) and the primary
    params = with_eos_stop_ids(SamplingParams(min_tokens=2), ids[1:])
    ignoring = with_eos_stop_ids(SamplingParams(min_tokens=2, ignore_eos=True), ids[1:])
    state = write_state(
        [params, ignoring], eos_token_id=ids[0], vocab=llm.llm_engine.model_config.vocab_size
    )
    assert np.flatnonzero(np.asarray(state.stop_mask[0])).tolist() == sorted(ids)
    assert not np.asarray(state.stop_mask[1]).any()  # ignore_eos: no EOS id is banned
    assert_no_block_leaks(llm)


def test_beam_search_completes_at_every_eos_id(llm, eos_ids):
    """Every hypothesis ending in an EOS id is complete ("stop", that id); with only EOS ids
    the greedy path reaches, beam_width 1 follows it to the third id."""
    ids, stop_at = eos_ids
    (out,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=stop_at + 2))
    for s in out.sequences:
        ends_in_eos = s.tokens[-1] in ids
        assert (s.finish_reason == "stop") == ends_in_eos
        if ends_in_eos:
            assert s.stop_reason == s.tokens[-1]
        assert not set(s.tokens[len(PROMPT) : -1]) & set(ids)
    assert_no_block_leaks(llm)


# ---- whole-vocabulary logprobs (max_logprobs=-1) -------------------------------------------------


@pytest.fixture(scope="module")
def vocab_llm(model):
    """max_logprobs=-1 (the vocabulary) is an engine option: the one other engine here."""
    return make_llm(model, max_logprobs=-1, max_model_len=64)


def test_whole_vocabulary_logprobs(vocab_llm, greedy):
    """Before: logprobs=-1 raised IndexError inside the step (and broke the next generate)."""
    engine = vocab_llm.llm_engine
    assert engine.config.max_logprobs == -1
    (out,) = vocab_llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=2, temperature=0, logprobs=-1, ignore_eos=True),
        use_tqdm=False,
    )
    c = out.outputs[0]
    assert c.token_ids == greedy["prompt"][:2]
    assert [len(lp) for lp in c.logprobs] == [VOCAB, VOCAB]
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp[tok].rank == 1
        assert math.isclose(sum(math.exp(x.logprob) for x in lp.values()), 1.0, rel_tol=1e-4)
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs))
    )
    with pytest.raises(
        ValueError, match=f"logprobs=513 is larger than the vocabulary size {VOCAB}"
    ):
        engine.add_request("big", PROMPT, SamplingParams(logprobs=VOCAB + 1))
    assert not engine.has_unfinished_requests() and engine.get_stats().kv_cache_usage == 0


def test_whole_vocabulary_prompt_logprobs(vocab_llm, model):
    """Before: prompt_logprobs=-1 reached the worker as -1, which reads it as "none": the
    output was ``[None]``."""
    (out,) = vocab_llm.generate(
        [PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=-1), use_tqdm=False
    )
    assert out.prompt_logprobs[0] is None
    assert [len(p) for p in out.prompt_logprobs[1:]] == [VOCAB] * (len(PROMPT) - 1)
    lsm = np.asarray(
        jax.nn.log_softmax(dense_forward(model, jnp.asarray([PROMPT], jnp.int32))[0], axis=-1)
    )
    for pos in range(1, len(PROMPT)):
        np.testing.assert_allclose(
            out.prompt_logprobs[pos][PROMPT[pos]].logprob, lsm[pos - 1, PROMPT[pos]], atol=1e-4
        )
    assert vocab_llm.llm_engine.get_stats().kv_cache_usage == 0


def test_whole_vocabulary_logprobs_when_the_vocabulary_is_not_a_power_of_two():
    """tiny-llama's 32000 tokens: the step rounds top-k sizes up to powers of two (512 here,
    past the 500 tokens), and must still return each row's whole vocabulary."""
    llm = make_llm(small_model(vocab_size=500), max_logprobs=-1, max_model_len=64)
    (out,) = llm.generate(
        [PROMPT],
        SamplingParams(
            max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
        ),
        use_tqdm=False,
    )
    assert [len(p) for p in out.prompt_logprobs[1:]] == [500] * (len(PROMPT) - 1)
    assert [len(lp) for lp in out.outputs[0].logprobs] == [500, 500]
    assert llm.llm_engine.get_stats().kv_cache_usage == 0


# ---- engine configuration ----------------------------------------------------------------------


def test_llm_of_none_names_the_model_argument():
    with pytest.raises(
        TypeError, match="model must be a model name, a path or an NNX model .*got None"
    ):
        LLM(None)
    with pytest.raises(TypeError, match="model must be"):
        resolve_engine_config(5)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(enable_prefix_caching="no"),
            TypeError,
            "enable_prefix_caching must be a bool .*'no'",
        ),
        (dict(enable_chunked_prefill="no"), TypeError, "enable_chunked_prefill must be a bool"),
        (dict(enable_chunked_prefill=0), TypeError, "enable_chunked_prefill must be a bool"),
        (dict(async_scheduling="no"), TypeError, "async_scheduling must be a bool"),
        (dict(verbose="no"), TypeError, "verbose must be a bool"),
        (dict(warmup=1), ValueError, "warmup must be True or False, got 1"),
        (dict(max_logprobs=-2), ValueError, r"max_logprobs must be an int >= 0, or -1 .*-2"),
        (dict(max_logprobs=True), ValueError, "max_logprobs must be"),
        (dict(max_logprobs="20"), ValueError, "max_logprobs must be"),
        (dict(seed="x"), TypeError, "seed must be an int, got 'x'"),
        (dict(seed=1.5), TypeError, "seed must be an int"),
        (dict(seed=2**63), ValueError, r"seed must be in \[-2\*\*63, 2\*\*63\)"),
        (dict(dtype="f16"), ValueError, "dtype must be one of"),
        (
            dict(gpu_memory_utilization="0.5"),
            ValueError,
            r"gpu_memory_utilization must be a number in \(0, 1\]",
        ),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=math.nan), ValueError, "gpu_memory_utilization"),
        (
            dict(num_gpu_blocks_override=10.0),
            TypeError,
            "num_gpu_blocks_override must be an int or None",
        ),
        (
            dict(num_gpu_blocks_override=True),
            TypeError,
            "num_gpu_blocks_override must be an int or None",
        ),
        (dict(attention_backend="bogus"), ValueError, "attention_backend must be one of"),
        (dict(pipeline_parallel_size=1.0), ValueError, "pipeline_parallel_size=1.0"),
        (dict(tokenizer=5), TypeError, r"tokenizer must have encode\(\) and decode\(\)"),
    ],
)
def test_engine_config_refuses_wrong_types(model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        resolve_engine_config(
            model, **{"kv_cache_memory_bytes": 8 << 20, "warmup": False, **kwargs}
        )


def test_engine_config_defaults(model, eos_ids):
    ids, _ = eos_ids
    _, _, _, config = resolve_engine_config(
        model,
        kv_cache_memory_bytes=8 << 20,
        max_model_len=128,
        max_num_batched_tokens=64,
        warmup=False,
    )
    assert config.max_logprobs == 20  # vLLM's default
    assert config.eos_token_ids == ids[1:]  # no tokenizer: the model config's ids, in order
    assert config.scheduler_config.eos_token_id == ids[1]


@pytest.mark.parametrize(
    "flag",
    [
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "enable_kv_cache_events",
        "log_stats",
        "async_scheduling",
    ],
)
def test_scheduler_config_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'no'"):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, **{flag: "no"})
