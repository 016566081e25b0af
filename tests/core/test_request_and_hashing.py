"""Request bookkeeping and chained block hashes."""

import hashlib
import pickle

import pytest

from jaxkv.core import (
    Request,
    RequestStatus,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
)
from jaxkv.core.block_hash import sha256


def test_none_hash_is_fixed_and_seeded(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert (
        init_none_hash(sha256)
        == hashlib.sha256(pickle.dumps("jaxkv-none-hash", protocol=5)).digest()
    )
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert init_none_hash(sha256) == sha256("7")
    assert isinstance(init_none_hash(get_hash_fn("builtin")), int)


def test_chained_hashes_and_salt_in_first_block_only():
    hash_fn = get_hash_fn("sha256")
    hasher = get_request_block_hasher(2, hash_fn)
    r = Request("r", [5, 6, 7, 8, 9], block_hasher=hasher)
    h0 = hash_block_tokens(hash_fn, None, (5, 6), None)
    h1 = hash_block_tokens(hash_fn, h0, (7, 8), None)
    assert r.block_hashes == [h0, h1]  # token 9 is a partial block

    salted = Request("s", [5, 6, 7, 8], cache_salt="tenant-a", block_hasher=hasher)
    s0 = hash_block_tokens(hash_fn, None, (5, 6), ("tenant-a",))
    assert salted.block_hashes == [s0, hash_block_tokens(hash_fn, s0, (7, 8), None)]
    assert salted.block_hashes[0] != h0


def test_hashes_extend_as_tokens_are_appended():
    hasher = get_request_block_hasher(4, get_hash_fn("builtin"))
    r = Request("r", [1, 2, 3], block_hasher=hasher)
    assert r.block_hashes == []
    r.append_output_token_ids(4)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([5, 6, 7, 8, 9])
    assert len(r.block_hashes) == 2
    again = Request("again", [1, 2, 3, 4, 5, 6, 7, 8], block_hasher=hasher)
    assert again.block_hashes == r.block_hashes  # same tokens, same chain
    assert (r.num_tokens, r.num_output_tokens, r.num_prompt_tokens) == (9, 6, 3)
    r.spec_token_ids = [1, 2]
    assert r.num_tokens_with_spec == 11


def test_request_status_and_validation():
    r = Request("r", [1])
    assert r.status is RequestStatus.WAITING and not r.is_finished() and r.block_hashes == []
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.is_finished() and r.get_finished_reason() == "length"
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_ABORTED) == "abort"
    assert RequestStatus.get_finished_reason(RequestStatus.PREEMPTED) is None
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [])
    with pytest.raises(ValueError, match="block_size must be positive"):
        get_request_block_hasher(0, get_hash_fn("sha256"))
    with pytest.raises(ValueError, match="unknown hash_algo 'md5'"):
        get_hash_fn("md5")
