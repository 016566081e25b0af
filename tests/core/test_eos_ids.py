"""Several EOS ids (Llama 3's ``eos_token_id: [128001, 128008, 128009]``): merged with the
tokenizer's, every one stops a request unless ``ignore_eos`` (host side, no jax)."""

import math

import pytest

from jaxkv.beam_search import BeamSearchParams, beam_search_score, run_beam_search
from jaxkv.core import Request, RequestStatus
from jaxkv.core.stop_check import append_and_check_stop, merge_eos_token_ids, with_eos_stop_ids
from jaxkv.outputs import Logprob
from jaxkv.sampling_params import SamplingParams

LLAMA3 = (128001, 128008, 128009)


def test_merge_puts_the_tokenizer_first_and_keeps_each_id_once():
    assert merge_eos_token_ids(None, LLAMA3) == LLAMA3
    assert merge_eos_token_ids(128009, LLAMA3) == (128009, 128001, 128008)  # tokenizer's primary
    assert merge_eos_token_ids(2, 2) == (2,)
    assert merge_eos_token_ids(None, None) == ()
    assert merge_eos_token_ids(None, [5, -1]) == (5,)  # -1: "no EOS" in some checkpoints
    with pytest.raises(TypeError, match="EOS token ids must be ints"):
        merge_eos_token_ids(None, ("2",))


def test_extra_eos_ids_join_the_stop_token_ids_unless_ignore_eos():
    user = SamplingParams(stop_token_ids=[7, 128008])
    params = with_eos_stop_ids(user, LLAMA3[1:])
    assert params.stop_token_ids == [7, 128008, 128009]
    assert user.stop_token_ids == [7, 128008]  # the caller's object is left alone
    ignoring = SamplingParams(ignore_eos=True)
    assert with_eos_stop_ids(ignoring, LLAMA3[1:]) is ignoring
    plain = SamplingParams()
    assert with_eos_stop_ids(plain, ()) is plain


def _request(params: SamplingParams) -> Request:
    eos_ids = merge_eos_token_ids(None, LLAMA3)
    return Request("r", [1, 2, 3], with_eos_stop_ids(params, eos_ids[1:]), eos_token_id=eos_ids[0])


@pytest.mark.parametrize("eos", LLAMA3)
def test_every_eos_id_stops_generation(eos):
    request = _request(SamplingParams(max_tokens=10))
    appended, stopped = append_and_check_stop(request, [11, eos, 12], max_model_len=100)
    # the tokens after the stop are dropped; the primary EOS has no stop_reason (vLLM's
    # convention), the others report their id as a stop token does
    assert (appended, stopped) == ([11, eos], True)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.get_finished_reason() == "stop"
    assert request.stop_reason == (None if eos == LLAMA3[0] else eos)


def test_ignore_eos_generates_through_every_eos_id():
    request = _request(SamplingParams(max_tokens=10, ignore_eos=True))
    appended, stopped = append_and_check_stop(request, list(LLAMA3), max_model_len=100)
    assert (appended, stopped) == (list(LLAMA3), False)
    assert request.status == RequestStatus.WAITING


def test_min_tokens_holds_back_every_eos_id():
    request = _request(SamplingParams(max_tokens=10, min_tokens=3))
    # outputs 1 and 2 are EOS ids but come before min_tokens; output 3 stops
    appended, stopped = append_and_check_stop(
        request, [128009, 128008, 128001, 5], max_model_len=100
    )
    assert (appended, stopped) == ([128009, 128008, 128001], True)
    assert request.stop_reason is None  # the primary


def test_beam_search_completes_a_hypothesis_at_any_eos_id():
    """Candidates 8 and 9 are both EOS ids: each completes its hypothesis ("stop"), and the
    score leaves a final EOS, whichever, out of the length."""
    table = {(0,): {8: 0.5, 9: 0.3, 1: 0.2}, (0, 1): {2: 1.0}}

    def expand(beams):
        return [{t: Logprob(math.log(p)) for t, p in table[tuple(b)].items()} for b in beams]

    out = run_beam_search([[0]], BeamSearchParams(beam_width=3, max_tokens=2), expand, (8, 9))[0]
    got = sorted((tuple(s.tokens), s.finish_reason, s.stop_reason) for s in out.sequences)
    assert got == [((0, 1, 2), "length", None), ((0, 8), "stop", 8), ((0, 9), "stop", 9)]
    assert beam_search_score([0, 9], -1.0, (8, 9), 1.0) == pytest.approx(-1.0)
    assert beam_search_score([0, 9], -1.0, 8, 1.0) == pytest.approx(-0.5)
