"""The device sampling state: slots handed to requests, the fixed-size updates that write them,
and what a reused slot keeps (nothing)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.sampling_state import (
    ENTRY_ALLOW,
    ENTRY_BIAS,
    ENTRY_HISTORY,
    ENTRY_STOP,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    SamplingStateUpdate,
    state_bytes,
)
from jaxkv.worker.sampling_updates import (
    SlotAllocator,
    SlotInit,
    build_updates,
    check_bad_words,
    needs_processing,
)
from tests.worker.sampler_helpers import V, _apply, write_state


def test_slot_allocator_lowest_first_and_preferred():
    slots = SlotAllocator(4)
    assert [slots.take(r) for r in "abc"] == [0, 1, 2]
    assert slots.release("b") == 1 and slots.release("b") is None
    assert slots.take("d") == 1  # the lowest free slot
    assert slots.release("a") == 0
    assert slots.take("e", prefer=3) == 3  # a preferred free slot
    assert slots.take("a", prefer=2) == 0  # taken: the lowest instead
    with pytest.raises(ValueError, match="no free sampling slot"):
        slots.take("f")
    with pytest.raises(ValueError, match="already holds"):
        slots.take("a")


def test_updates_are_fixed_size_and_sorted_by_kind():
    """Every update has the same arrays (one compiled program); entries overflow into further
    updates in kind order: all allow-list entries before any bias, stop or history entry."""
    params = [
        SamplingParams(logit_bias={1: 1.0, 2: 2.0}, allowed_token_ids=[1, 2, 3]),
        SamplingParams(presence_penalty=0.5, min_tokens=1, stop_token_ids=[9]),
    ]
    inits = [
        SlotInit(
            slot=i,
            params=p,
            key_data=np.zeros(2, np.uint32),
            token_ids=[4, 5, 6],
            num_prompt_tokens=2,
        )
        for i, p in enumerate(params)
    ]
    updates = build_updates(inits, num_updates=4, num_entries=3, eos_token_id=7)
    shapes = {k: v.shape for k, v in updates[0].items()}
    assert all({k: v.shape for k, v in u.items()} == shapes for u in updates)
    kinds = [k for u in updates for k, s in zip(u["entry_kind"], u["entry_slot"]) if s >= 0]
    assert (
        kinds
        == sorted(kinds)
        == [ENTRY_ALLOW] * 3 + [ENTRY_BIAS] * 2 + [ENTRY_STOP] * 2 + [ENTRY_HISTORY] * 3
    )
    assert updates[0]["slots"].tolist() == [0, 1, -1, -1] and (updates[1]["slots"] == -1).all()
    assert build_updates([], num_updates=4, num_entries=3) == []
    with pytest.raises(ValueError, match="exceed one update"):
        build_updates(inits, num_updates=1, num_entries=3)


def test_a_reused_slot_keeps_nothing_of_its_last_request():
    state = write_state(
        [
            SamplingParams(
                allowed_token_ids=[1], min_tokens=2, stop_token_ids=[3], temperature=0.5, seed=1
            )
        ],
        eos_token_id=4,
    )
    assert (
        np.isneginf(np.asarray(state.bias[0])).sum() == V - 1
        and np.asarray(state.stop_mask[0]).sum() == 2
    )
    (update,) = build_updates(
        [
            SlotInit(
                slot=0,
                params=SamplingParams(temperature=0.0),
                key_data=np.zeros(2, np.uint32),
                token_ids=[],
                num_prompt_tokens=0,
            )
        ],
        num_updates=1,
        num_entries=4,
    )
    state = _apply(state, SamplingStateUpdate(**{k: jnp.asarray(v) for k, v in update.items()}))
    assert not np.asarray(state.bias[0]).any() and not np.asarray(state.stop_mask[0]).any()
    assert float(state.temperature[0]) == 0.0 and not bool(state.biased[0])


def test_bad_word_limits_and_processing_rule():
    check_bad_words([[1] * MAX_BAD_WORD_TOKENS] * MAX_BAD_WORDS)
    with pytest.raises(ValueError, match=f"at most {MAX_BAD_WORDS} per request"):
        check_bad_words([[1]] * (MAX_BAD_WORDS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_BAD_WORD_TOKENS} per word"):
        check_bad_words([[1] * (MAX_BAD_WORD_TOKENS + 1)])
    assert not needs_processing(SamplingParams(temperature=0.0), 0)
    assert needs_processing(SamplingParams(temperature=0.0, min_tokens=2), 1)
    assert not needs_processing(SamplingParams(temperature=0.0, min_tokens=2), 2)
    for kw in (
        dict(temperature=0.5),
        dict(logprobs=0),
        dict(presence_penalty=0.1),
        dict(logit_bias={1: 1.0}),
        dict(allowed_token_ids=[1]),
        dict(bad_words_token_ids=[[1]]),
    ):
        assert needs_processing(SamplingParams(**{"temperature": 0.0, **kw}), 0), kw


def test_state_bytes():
    # 3 slots, vocab 10, 8 tokens: 10 scalars (4 bytes, bool 1) + key 8 + bias 40 + stop 10 + history 32 + words
    words = 4 * MAX_BAD_WORDS * MAX_BAD_WORD_TOKENS
    assert state_bytes(3, 10, 8) == 3 * (9 * 4 + 1 + 8 + 40 + 10 + 32 + words)


def test_an_update_rewrites_only_its_own_slots_rows():
    """Rows are reset one slot at a time: the other slots keep their rows, and the padding of
    an update (slot -1) leaves the neutral slot neutral."""
    state = write_state(
        [
            SamplingParams(allowed_token_ids=[1, 2], stop_token_ids=[3]),
            SamplingParams(stop_token_ids=[5, 6], logit_bias={7: 1.5}),
        ],
        num_slots=3,
    )
    before = {k: np.asarray(getattr(state, k)) for k in ("bias", "stop_mask")}
    (update,) = build_updates(
        [
            SlotInit(
                slot=1,
                params=SamplingParams(allowed_token_ids=[4]),
                key_data=np.zeros(2, np.uint32),
                token_ids=[],
                num_prompt_tokens=0,
            )
        ],
        num_updates=3,
        num_entries=4,
    )
    assert update["slots"].tolist() == [1, -1, -1]
    state = _apply(state, SamplingStateUpdate(**{k: jnp.asarray(v) for k, v in update.items()}))
    bias, stop = np.asarray(state.bias), np.asarray(state.stop_mask)
    np.testing.assert_array_equal(bias[0], before["bias"][0])  # slot 0 untouched
    np.testing.assert_array_equal(stop[0], before["stop_mask"][0])
    assert np.isneginf(bias[1]).sum() == V - 1 and bias[1, 4] == 0.0  # slot 1 rewritten
    assert not stop[1].any()
    assert state.neutral_slot == 3
    assert not bias[2:].any() and not stop[2:].any()  # the free slot 2 and the neutral slot 3
