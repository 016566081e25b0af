"""Per-request sampling options on the device: fixed-capacity state that changes when a request joins.

Every ``SamplingParams`` feature is data with a neutral value, held in one *slot* of a
:class:`SamplingState` (vLLM's persistent batch, on the device). A request takes a free slot
when it enters the runner's batch and keeps it until it leaves (finished, preempted or not
scheduled); the slot is written once, at entry, by :func:`apply_update`, so a step sends only
each row's slot and counters. Nothing here is a shape that depends on the requests: the
sampling programs compile once per request bucket, whatever the batch asks for.

What a slot holds, and its neutral value:

=====================  ==================  =============================================
field                  shape               neutral
=====================  ==================  =============================================
temperature            [R1] f32            0 (greedy)
top_k / top_p / min_p  [R1]                0 / 1 / 0 (off)
presence / frequency   [R1] f32            0
repetition             [R1] f32            1
key_data               [R1, 2] u32         the request's threefry key
min_tokens             [R1] i32            0 (stop ids are banned while outputs < this)
num_prompt_tokens      [R1] i32            history columns before this are the prompt
biased                 [R1] bool           False: ``bias`` row is all zeros
bias                   [R1, V] f32         0; -inf for tokens outside ``allowed_token_ids``,
                                           plus ``logit_bias``
stop_mask              [R1, V] bool        False; stop ids + EOS (unless ignore_eos)
history                [R1, L] i32         the request's tokens (prompt, then outputs),
                                           written only for requests with penalties or
                                           bad words; the heads append each sampled token
bad_words              [R1, BW, BL] i32    PAD; each word right-aligned (its last token in
                                           column BL - 1)
=====================  ==================  =============================================

Shape names: ``R1 = max_num_seqs + 1`` slots (the last, :attr:`SamplingState.neutral_slot`, is
never handed out: padding rows read it), ``V`` vocabulary, ``L = max_model_len``, ``BW`` /
``BL`` the bad-word capacity (:data:`MAX_BAD_WORDS` words of at most :data:`MAX_BAD_WORD_TOKENS`
tokens per request), ``U`` slots and ``E`` entries one update carries.

Memory: ``R1 * (5 V + 4 L + 4 BW BL)`` bytes, e.g. 64 slots of a 49k vocabulary and 2k
context: 16 MiB (:func:`state_bytes`; the KV budget leaves room for it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

#: Padding of token-id lists (bad words, history beyond a row's tokens): matches no token.
PAD_TOKEN_ID = -1
#: Bad words per request, and tokens per bad word, a slot holds (a request with more is refused).
MAX_BAD_WORDS = 32
MAX_BAD_WORD_TOKENS = 16

#: Entry kinds of an update, applied in this order within one update (and sent in this order).
ENTRY_ALLOW, ENTRY_BIAS, ENTRY_STOP, ENTRY_HISTORY = 0, 1, 2, 3

_SCALARS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "num_prompt_tokens",
    "biased",
)
_INT_SCALARS = ("top_k", "min_tokens", "num_prompt_tokens")


@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Sampling options of every slot (see the module docstring for the fields)."""

    temperature: jax.Array  # [R1] float32
    top_k: jax.Array  # [R1] int32
    top_p: jax.Array  # [R1] float32
    min_p: jax.Array  # [R1] float32
    presence_penalty: jax.Array  # [R1] float32
    frequency_penalty: jax.Array  # [R1] float32
    repetition_penalty: jax.Array  # [R1] float32
    min_tokens: jax.Array  # [R1] int32
    num_prompt_tokens: jax.Array  # [R1] int32
    biased: jax.Array  # [R1] bool
    key_data: jax.Array  # [R1, 2] uint32
    bias: jax.Array  # [R1, V] float32
    stop_mask: jax.Array  # [R1, V] bool
    history: jax.Array  # [R1, L] int32
    bad_words: jax.Array  # [R1, BW, BL] int32

    @property
    def num_slots(self) -> int:
        return self.temperature.shape[0]

    @property
    def neutral_slot(self) -> int:
        """The slot padding rows read: greedy, nothing set (never handed to a request)."""
        return self.num_slots - 1


jax.tree_util.register_dataclass(
    SamplingState, data_fields=[f.name for f in dataclasses.fields(SamplingState)], meta_fields=[]
)


def state_shapes(
    num_slots: int, vocab_size: int, max_model_len: int
) -> dict[str, tuple[tuple, np.dtype]]:
    """Each field's (shape, dtype) for ``num_slots`` slots (R1, the neutral one included)."""
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    out = {name: ((num_slots,), i32 if name in _INT_SCALARS else f32) for name in _SCALARS}
    out["biased"] = ((num_slots,), np.dtype(np.bool_))
    out["key_data"] = ((num_slots, 2), np.dtype(np.uint32))
    out["bias"] = ((num_slots, vocab_size), f32)
    out["stop_mask"] = ((num_slots, vocab_size), np.dtype(np.bool_))
    out["history"] = ((num_slots, max_model_len), i32)
    out["bad_words"] = ((num_slots, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), i32)
    return out


def state_bytes(num_slots: int, vocab_size: int, max_model_len: int) -> int:
    """Device bytes of a SamplingState (one copy; replicated on every device of a mesh)."""
    return sum(
        int(np.prod(s)) * d.itemsize
        for s, d in state_shapes(num_slots, vocab_size, max_model_len).values()
    )


def neutral_host_state(
    num_slots: int, vocab_size: int, max_model_len: int
) -> dict[str, np.ndarray]:
    """Every slot neutral, as numpy arrays keyed by field name."""
    out = {
        name: np.zeros(shape, dtype)
        for name, (shape, dtype) in state_shapes(num_slots, vocab_size, max_model_len).items()
    }
    out["top_p"][:] = 1.0
    out["repetition_penalty"][:] = 1.0
    out["history"][:] = PAD_TOKEN_ID
    out["bad_words"][:] = PAD_TOKEN_ID
    return out


def allocate_state(
    num_slots: int, vocab_size: int, max_model_len: int, put=jnp.asarray
) -> SamplingState:
    """A SamplingState with every slot neutral; ``put`` places each field (a mesh's
    replicated placement, or the default device)."""
    host = neutral_host_state(num_slots, vocab_size, max_model_len)
    return SamplingState(**{k: put(v) for k, v in host.items()})


@dataclasses.dataclass(frozen=True)
class SamplingStateUpdate:
    """One fixed-capacity update: up to U slots (re)initialised, then up to E entries.

    A slot in ``slots`` gets its scalars and bad words, its ``bias`` row reset (to -inf where
    it has an allow-list, else 0) and its ``stop_mask`` row cleared; then the entries apply,
    by kind in order: ALLOW (``bias[slot, token] = 0``), BIAS (``bias[slot, token] += value``),
    STOP (``stop_mask[slot, token] = True``), HISTORY (``history[slot, index] = token``).
    Padding slots and entries are -1 and touch nothing.
    """

    slots: jax.Array  # [U] int32, -1: padding
    temperature: jax.Array  # [U] float32
    top_k: jax.Array  # [U] int32
    top_p: jax.Array  # [U] float32
    min_p: jax.Array  # [U] float32
    presence_penalty: jax.Array  # [U] float32
    frequency_penalty: jax.Array  # [U] float32
    repetition_penalty: jax.Array  # [U] float32
    min_tokens: jax.Array  # [U] int32
    num_prompt_tokens: jax.Array  # [U] int32
    biased: jax.Array  # [U] bool
    has_allowed: jax.Array  # [U] bool: the bias row starts at -inf
    key_data: jax.Array  # [U, 2] uint32
    bad_words: jax.Array  # [U, BW, BL] int32
    entry_slot: jax.Array  # [E] int32, -1: padding
    entry_kind: jax.Array  # [E] int32, ENTRY_*
    entry_index: jax.Array  # [E] int32: a token id (ALLOW, BIAS, STOP) or a position (HISTORY)
    entry_value: jax.Array  # [E] int32: the token id (HISTORY) or the bias's float32 bits (BIAS)


jax.tree_util.register_dataclass(
    SamplingStateUpdate,
    data_fields=[f.name for f in dataclasses.fields(SamplingStateUpdate)],
    meta_fields=[],
)


def apply_update(state: SamplingState, update: SamplingStateUpdate) -> SamplingState:
    """``state`` with ``update`` applied (jittable; donate ``state`` to update it in place)."""
    num_slots = state.num_slots
    slots = jnp.where(update.slots < 0, num_slots, update.slots)  # padding -> dropped
    fields = {}
    for name in _SCALARS + ("key_data", "bad_words"):
        fields[name] = getattr(state, name).at[slots].set(getattr(update, name), mode="drop")
    bias, stop_mask = _reset_rows(state, update)

    def rows_of(kind):  # entries of one kind: their slot, others dropped
        return jnp.where(
            (update.entry_kind == kind) & (update.entry_slot >= 0), update.entry_slot, num_slots
        )

    tok = update.entry_index
    bias = bias.at[rows_of(ENTRY_ALLOW), tok].set(0.0, mode="drop")
    bias = bias.at[rows_of(ENTRY_BIAS), tok].add(
        jax.lax.bitcast_convert_type(update.entry_value, jnp.float32), mode="drop"
    )
    stop_mask = stop_mask.at[rows_of(ENTRY_STOP), tok].set(True, mode="drop")
    history = state.history.at[rows_of(ENTRY_HISTORY), tok].set(update.entry_value, mode="drop")
    return SamplingState(**fields, bias=bias, stop_mask=stop_mask, history=history)


def _reset_rows(state: SamplingState, update: SamplingStateUpdate) -> tuple[jax.Array, jax.Array]:
    """``state``'s ``bias`` [R1, V] and ``stop_mask`` [R1, V] with each updated slot's row reset.

    One row at a time, in place when ``state`` is donated: a scatter of whole rows would
    first build its [U, V] updates (at 64 slots of a 32k vocabulary ~8 MB for each of the two
    bias resets and ~2 MB for the stop mask: most of a ~25 ms update on a CPU); these writes
    touch only the slots' rows. Padding slots (-1) rewrite the neutral slot with its own
    neutral row.
    """
    num_slots, vocab = state.bias.shape
    slots = jnp.where(update.slots < 0, num_slots - 1, update.slots)  # [U]
    start = jnp.where(update.has_allowed & (update.slots >= 0), -jnp.inf, 0.0)  # [U] f32

    def reset(u, carry):
        bias, stop_mask = carry
        row = jnp.full((1, vocab), start[u], bias.dtype)
        bias = jax.lax.dynamic_update_slice(bias, row, (slots[u], 0))
        off = jnp.zeros((1, vocab), stop_mask.dtype)
        return bias, jax.lax.dynamic_update_slice(stop_mask, off, (slots[u], 0))

    return jax.lax.fori_loop(0, slots.shape[0], reset, (state.bias, state.stop_mask))
