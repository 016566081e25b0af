"""SamplingParams: vLLM defaults, normalisation and validation."""

import numpy as np
import pytest

from jaxkv.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs, p.prompt_logprobs) == (
        16,
        0,
        False,
        None,
        None,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy and p.sampling_type is SamplingType.RANDOM


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1)
    assert greedy.greedy and greedy.sampling_type is SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(bad_words="oops").bad_words == ["oops"]
    assert SamplingParams(bad_words_token_ids=[(3, 4)]).bad_words_token_ids == [[3, 4]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens must be an int >= 1.*0"),
        ({"max_tokens": -3}, "-3"),
        ({"temperature": -0.5}, "temperature.*-0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "1.5"),
        ({"top_k": -2}, "top_k.*-2"),
        ({"min_p": 1.2}, "min_p.*1.2"),
        ({"n": 0}, "n must be"),
        ({"min_tokens": 5, "max_tokens": 3}, r"min_tokens \(5\) must be <= max_tokens \(3\)"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -5}, "logprobs"),
        ({"stop": ["ok", ""]}, "non-empty"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words must be non-blank strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an int >= 1 or -1, got 0"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens.*-2"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids must be non-empty"),
        ({"bad_words_token_ids": [[1, -2]]}, "bad_words_token_ids.*-2"),
    ],
)
def test_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"temperature": "0.5"}, TypeError, "temperature must be a number, got '0.5'"),
        ({"top_p": None}, TypeError, "top_p must be a number, got None"),
        ({"repetition_penalty": True}, TypeError, "repetition_penalty must be a number"),
        ({"temperature": float("nan")}, ValueError, "temperature must not be NaN"),
        ({"min_p": float("nan")}, ValueError, "min_p must not be NaN"),
        ({"stop": 5}, TypeError, "stop must be a list or a str, got 5"),
        ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a list, got 5"),
        ({"allowed_token_ids": "abc"}, TypeError, "allowed_token_ids must be a list"),
        ({"bad_words": 5}, TypeError, "bad_words must be a list or a str"),
        ({"ignore_eos": "no"}, TypeError, "ignore_eos must be a bool, got 'no'"),
        ({"detokenize": 0}, TypeError, "detokenize must be a bool, got 0"),
        ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be a bool"),
    ],
)
def test_rejects_wrong_types_naming_the_field(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_numpy_scalars_are_numbers():
    assert SamplingParams(
        temperature=np.float32(0.5), top_p=np.float64(0.9)
    ).top_p == pytest.approx(0.9)
    p = SamplingParams(ignore_eos=np.bool_(True))
    assert p.ignore_eos is True


def test_bad_words_token_ids_must_be_lists_of_lists():
    with pytest.raises(TypeError, match="list of token-id lists"):
        SamplingParams(bad_words_token_ids=[1, 2])


def test_greedy_allows_n_greater_than_one():
    # vLLM V1 accepts n > 1 with greedy sampling; the completions are identical.
    p = SamplingParams(n=3, temperature=0.0)
    assert p.n == 3 and p.greedy
