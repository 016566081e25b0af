"""Host side of the device sampling state: slots for requests, and the updates that fill them.

The runner hands each request entering its batch a slot (:class:`SlotAllocator`) and writes
the slot once with :func:`build_updates`: fixed-capacity ``SamplingStateUpdate`` arrays (numpy),
as many as the entries need (a long prompt's history, a long allow-list), each applied by one
call of the same compiled update program. See :mod:`jaxkv.worker.sampling_state`.

Example: a request with ``allowed_token_ids=[5, 7]`` and ``logit_bias={7: 2.0}`` entering at
slot 3 gives one slot init (``has_allowed``: the row starts at -inf) and the entries
``(3, ALLOW, 5)``, ``(3, ALLOW, 7)``, ``(3, BIAS, 7, 2.0)``: token 5 ends at 0, token 7 at 2,
every other token at -inf.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxkv.sampling_params import SAMPLING_EPS
from jaxkv.worker.sampling_state import (
    ENTRY_ALLOW,
    ENTRY_BIAS,
    ENTRY_HISTORY,
    ENTRY_STOP,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    PAD_TOKEN_ID,
)

_INT32_MAX = int(np.iinfo(np.int32).max)


# ---- keys -------------------------------------------------------------------------------------


def make_request_key(seed: int) -> np.ndarray:  # [2] uint32
    """Threefry key data of a request seed (any int; taken modulo 2**64), computed on the host.

    Equals ``jax.random.key_data(jax.random.PRNGKey(seed))`` for 0 <= seed < 2**32; larger
    seeds keep their high 32 bits (PRNGKey drops them when x64 is off).
    """
    seed %= 1 << 64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def make_unseeded_request_key(engine_seed: int, req_id: str) -> np.ndarray:  # [2] uint32
    """Key of a request without a seed: a stable hash of (engine seed, request id).

    vLLM request ids are unique within an engine, so the id plays the role of a per-request
    counter; unlike a counter it needs no state and survives preemption and re-adding.
    """
    digest = hashlib.blake2b(f"{engine_seed}\0{req_id}".encode(), digest_size=8).digest()
    return make_request_key(int.from_bytes(digest, "little"))


# ---- what a request needs ----------------------------------------------------------------------


def uses_penalties(params) -> bool:
    """Whether sampling reads the request's tokens (repetition, frequency or presence penalty)."""
    return (
        getattr(params, "presence_penalty", 0.0) != 0
        or getattr(params, "frequency_penalty", 0.0) != 0
        or getattr(params, "repetition_penalty", 1.0) != 1
    )


def bad_words_of(params) -> list[list[int]]:
    return [list(w) for w in (getattr(params, "bad_words_token_ids", None) or ())]


def needs_history(params) -> bool:
    """Penalties, or a bad word of more than one token (matched against the latest outputs)."""
    return uses_penalties(params) or any(len(w) > 1 for w in bad_words_of(params))


def check_bad_words(words: Sequence[Sequence[int]]) -> None:
    """ValueError when the words do not fit a slot (:data:`MAX_BAD_WORDS` words of at most
    :data:`MAX_BAD_WORD_TOKENS` tokens)."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: {len(words)} words, at most {MAX_BAD_WORDS} per request")
    longest = max((len(w) for w in words), default=0)
    if longest > MAX_BAD_WORD_TOKENS:
        raise ValueError(
            f"bad_words: a word of {longest} tokens, at most {MAX_BAD_WORD_TOKENS} per word"
        )


def needs_processing(params, num_outputs: int) -> bool:
    """Whether a row's next token needs more than the argmax of its raw logits: it samples,
    or has penalties, an allow-list, a logit bias, bad words, min_tokens still banning stop
    ids, or asks for logprobs. Rows that do not take the greedy program."""
    return (
        getattr(params, "temperature", 0.0) >= SAMPLING_EPS
        or uses_penalties(params)
        or bool(getattr(params, "allowed_token_ids", None))
        or bool(getattr(params, "logit_bias", None))
        or bool(bad_words_of(params))
        or num_outputs < getattr(params, "min_tokens", 0)
        or getattr(params, "logprobs", None) is not None
    )


@dataclasses.dataclass(frozen=True)
class SlotInit:
    """One request entering a slot."""

    slot: int
    params: object  # SamplingParams (or duck-typed)
    key_data: np.ndarray  # [2] uint32
    token_ids: Sequence[int]  # prompt then outputs on the host (history, when needed)
    num_prompt_tokens: int


def _entries(init: SlotInit, *, eos_token_id: int | None) -> list[tuple[int, int, int, int]]:
    """(kind, slot, index, value) entries of one slot init."""
    p, s = init.params, init.slot
    out = [(ENTRY_ALLOW, s, t, 0) for t in getattr(p, "allowed_token_ids", None) or ()]
    bias = getattr(p, "logit_bias", None) or {}
    if bias:
        bits = np.asarray(list(bias.values()), np.float32).view(np.int32).tolist()
        out += [(ENTRY_BIAS, s, int(t), b) for t, b in zip(bias, bits)]
    if getattr(p, "min_tokens", 0):
        stop = list(getattr(p, "stop_token_ids", None) or ())
        if eos_token_id is not None and not getattr(p, "ignore_eos", False):
            stop.append(eos_token_id)
        out += [(ENTRY_STOP, s, int(t), 0) for t in dict.fromkeys(stop)]
    if needs_history(p):
        out += [(ENTRY_HISTORY, s, i, int(t)) for i, t in enumerate(init.token_ids)]
    return out


def empty_update(num_updates: int, num_entries: int) -> dict[str, np.ndarray]:
    """A ``SamplingStateUpdate`` (as numpy arrays by field) of U slots and E entries, all padding."""
    u, e, f32, i32 = num_updates, num_entries, np.float32, np.int32
    return {
        "slots": np.full(u, -1, i32),
        "temperature": np.zeros(u, f32),
        "top_k": np.zeros(u, i32),
        "top_p": np.ones(u, f32),
        "min_p": np.zeros(u, f32),
        "presence_penalty": np.zeros(u, f32),
        "frequency_penalty": np.zeros(u, f32),
        "repetition_penalty": np.ones(u, f32),
        "min_tokens": np.zeros(u, i32),
        "num_prompt_tokens": np.zeros(u, i32),
        "biased": np.zeros(u, bool),
        "has_allowed": np.zeros(u, bool),
        "key_data": np.zeros((u, 2), np.uint32),
        "bad_words": np.full((u, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), PAD_TOKEN_ID, i32),
        "entry_slot": np.full(e, -1, i32),
        "entry_kind": np.zeros(e, i32),
        "entry_index": np.zeros(e, i32),
        "entry_value": np.zeros(e, i32),
    }


def build_updates(
    inits: Sequence[SlotInit],
    *,
    num_updates: int,
    num_entries: int,
    eos_token_id: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """The updates that write ``inits`` (at most ``num_updates`` U of them): the first holds
    every slot's scalars and bad words plus the first E entries, each further one E more
    entries (sorted by kind, so across updates they apply in kind order). Empty for no inits."""
    if not inits:
        return []
    if len(inits) > num_updates:
        raise ValueError(f"{len(inits)} slot inits exceed one update's {num_updates} slots")
    first = empty_update(num_updates, num_entries)
    entries = []
    for i, init in enumerate(inits):
        p = init.params
        first["slots"][i] = init.slot
        first["temperature"][i] = p.temperature
        first["top_k"][i] = max(int(p.top_k), 0)
        first["top_p"][i], first["min_p"][i] = p.top_p, p.min_p
        first["presence_penalty"][i] = p.presence_penalty
        first["frequency_penalty"][i] = p.frequency_penalty
        first["repetition_penalty"][i] = p.repetition_penalty
        # min_tokens may exceed int32 (any int is valid; max_model_len ends the row first)
        first["min_tokens"][i] = min(int(getattr(p, "min_tokens", 0)), _INT32_MAX)
        first["num_prompt_tokens"][i] = init.num_prompt_tokens
        has_allowed = bool(getattr(p, "allowed_token_ids", None))
        first["has_allowed"][i] = has_allowed
        first["biased"][i] = has_allowed or bool(getattr(p, "logit_bias", None))
        first["key_data"][i] = np.asarray(init.key_data, np.uint32)
        words = bad_words_of(p)
        check_bad_words(words)
        for b, w in enumerate(words):
            first["bad_words"][i, b, MAX_BAD_WORD_TOKENS - len(w) :] = w
        entries += _entries(init, eos_token_id=eos_token_id)
    entries.sort(key=lambda e: e[0])
    updates = [first]
    for start in range(0, len(entries), num_entries):
        if start:
            updates.append(empty_update(num_updates, num_entries))
        chunk = np.asarray(entries[start : start + num_entries], np.int64).reshape(-1, 4)
        u, n = updates[-1], chunk.shape[0]
        u["entry_kind"][:n], u["entry_slot"][:n] = chunk[:, 0], chunk[:, 1]
        u["entry_index"][:n] = chunk[:, 2]
        u["entry_value"][:n] = chunk[:, 3]  # int32 values (a bias's float32 bits may be negative)
    return updates


class SlotAllocator:
    """Slots ``0 .. num_slots - 1`` for requests (the neutral slot is not among them)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest
        self.slot_of: dict[str, int] = {}

    def take(self, req_id: str, prefer: int | None = None) -> int:
        """A free slot for ``req_id``: ``prefer`` if it is free, else the lowest."""
        if req_id in self.slot_of:
            raise ValueError(f"request {req_id!r} already holds slot {self.slot_of[req_id]}")
        if not self._free:
            raise ValueError(f"no free sampling slot for {req_id!r} ({self.num_slots} slots)")
        if prefer is not None and prefer in self._free:
            self._free.remove(prefer)
            slot = prefer
        else:
            slot = self._free.pop()
        self.slot_of[req_id] = slot
        return slot

    def release(self, req_id: str) -> int | None:
        """Frees ``req_id``'s slot; returns it (None when it held none)."""
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)
        return slot

    def clear(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.slot_of = {}
