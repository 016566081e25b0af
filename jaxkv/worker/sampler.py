"""The sampler: logits of the rows a step samples -> next token ids (+ logprobs).

Everything here runs on the device inside the sampling programs (``jaxkv.worker.heads``).
Each row's options come from its slot of the device :class:`~jaxkv.worker.sampling_state.SamplingState`
(:class:`SamplingRows` says which slot and the row's counters), so one compiled program serves
every mix of options: a feature no row of the step uses is skipped at run time (``lax.cond``
on the rows' data), never compiled out.

Order of operations (vLLM V1 ``Sampler.forward``):
  1. logprobs, if a row asks, from the *raw* logits (vLLM's default ``logprobs_mode =
     "raw_logprobs"``; ``LOGPROBS_MODES`` lists the others: the raw logits themselves, or the
     processed distribution a row samples from, after step 5, as logprobs or logits);
  2. ``allowed_token_ids`` (other tokens -inf) and ``logit_bias`` (the slot's ``bias`` row);
     banned tokens -> -inf (min_tokens: stop ids and EOS before ``min_tokens`` outputs; bad
     words: a word's last token when the row's latest outputs are the rest of the word);
  3. penalties: repetition (tokens in prompt or output), frequency and presence (output);
  4. greedy rows (``temperature < SAMPLING_EPS``) take the argmax of these logits, exactly;
  5. temperature, then min_p, then top_k / top_p (one sort per row), then a Gumbel-max draw.

Randomness is per request, never batch-wide: row ``i`` draws with
``fold_in(key_i, num_output_tokens_i)`` where ``key_i`` is the request's own key (from its
``seed``, or from the engine seed and the request id). A seeded request therefore gets the same
tokens alone or at any row of any batch, and after a preemption.

Shape names: ``S`` rows (or scored positions), ``V`` vocabulary, ``K`` top logprobs (the
engine's ``max_logprobs``), ``k`` drafts per request (speculative decoding, else 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.sampling_params import SAMPLING_EPS
from jaxkv.worker.logits_ops import (
    apply_banned_tokens,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    argmax,
    bad_word_bans,
    compute_logprobs,
    latest_outputs,
    random_sample,
    request_keys,
)
from jaxkv.worker.sampling_state import SamplingState

#: vLLM's ``logprobs_mode`` values: what the reported logprobs are computed from. "raw_*": the
#: model's logits; "processed_*": the logits the row samples from (allow-lists, bias, bans,
#: penalties, then temperature, min_p, top-k / top-p; greedy rows at temperature 1, untruncated),
#: masked tokens -inf. "*_logprobs" normalises them (log-softmax), "*_logits" reports them as is.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """The rows one sampling program samples: their slots in ``state`` and their counters.

    With speculative decoding a "row" is a scored position: its request's slot, that
    request's outputs so far plus the position's offset, and the drafts before it in
    ``prior_drafts`` (the outputs it follows if they are accepted).
    """

    state: SamplingState
    slots: jax.Array  # [S] int32 (padding rows: the neutral slot)
    num_output_tokens: jax.Array  # [S] int32 outputs before this token (key fold-in, min_tokens)
    num_history_tokens: jax.Array  # [S] int32 tokens (prompt + outputs) before ``prior_drafts``
    num_logprobs: jax.Array  # [S] int32 logprobs the row asks for, -1: none
    prior_drafts: jax.Array  # [S, k] int32 drafts before this position, PAD (k = 0: none)

    def get(self, name: str) -> jax.Array:
        """The rows' value of a per-slot scalar field of the state: [S]."""
        return getattr(self.state, name)[self.slots]


jax.tree_util.register_dataclass(
    SamplingRows, data_fields=[f.name for f in dataclasses.fields(SamplingRows)], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and their logprobs (zeros for every row when no row asks)."""

    sampled_token_ids: jax.Array  # [S] int32
    logprobs: jax.Array  # [S, K + 1] float32: sampled token first, then the top K
    logprob_token_ids: jax.Array  # [S, K + 1] int32, token ids of ``logprobs``
    sampled_rank: jax.Array  # [S] int32, 1-based rank of the sampled token


jax.tree_util.register_dataclass(
    SamplerOutput,
    data_fields=["sampled_token_ids", "logprobs", "logprob_token_ids", "sampled_rank"],
    meta_fields=[],
)


def _when(pred, fn, x):
    """``fn(x)`` if ``pred`` (a traced bool) else ``x``, skipped at run time."""
    return lax.cond(pred, fn, lambda y: y, x)


def processed_logits(
    logits: jax.Array,  # [S, V] float32, raw
    rows: SamplingRows,
) -> jax.Array:  # [S, V] float32: what greedy rows take the argmax of (steps 2-3)
    """Allow-lists and logit bias, bans (min_tokens, bad words), then penalties; each part
    runs only when some row of the step has it."""
    state, slots = rows.state, rows.slots
    logits = _when(jnp.any(rows.get("biased")), lambda x: x + state.bias[slots], logits)
    min_tokens = rows.get("min_tokens")
    banning = rows.num_output_tokens < min_tokens  # [S]
    logits = _when(
        jnp.any(banning),
        lambda x: jnp.where(state.stop_mask[slots] & banning[:, None], -jnp.inf, x),
        logits,
    )
    words = state.bad_words[slots]  # [S, BW, BL]

    def ban_words(x):
        latest = latest_outputs(
            state.history,
            slots,
            rows.get("num_prompt_tokens"),
            rows.num_history_tokens,
            rows.prior_drafts,
            words.shape[2] - 1,
        )
        return apply_banned_tokens(x, bad_word_bans(words, latest))

    logits = _when(jnp.any(words[:, :, -1] >= 0), ban_words, logits)
    presence, frequency = rows.get("presence_penalty"), rows.get("frequency_penalty")
    repetition = rows.get("repetition_penalty")
    penalised = (presence != 0) | (frequency != 0) | (repetition != 1)

    def penalise(x):
        return apply_penalties(
            x,
            state.history[slots],
            rows.get("num_prompt_tokens"),
            rows.num_history_tokens,
            rows.prior_drafts,
            presence,
            frequency,
            repetition,
        )

    return _when(jnp.any(penalised), penalise, logits)


def scaled_logits(
    logits: jax.Array,  # [S, V] float32, processed
    rows: SamplingRows,
) -> jax.Array:  # [S, V] float32: the distribution random rows draw from (step 5)
    """Temperature (1 for greedy rows), then min_p, then top_k / top_p (when a random row
    truncates)."""
    temperature = rows.get("temperature")
    temperature = jnp.where(temperature < SAMPLING_EPS, 1.0, temperature)
    scaled = apply_min_p(logits / temperature[:, None], rows.get("min_p"))
    top_k, top_p = rows.get("top_k"), rows.get("top_p")
    truncates = (rows.get("temperature") >= SAMPLING_EPS) & ((top_k > 0) | (top_p < 1))
    return _when(jnp.any(truncates), lambda x: apply_top_k_top_p(x, top_k, top_p), scaled)


def _with_logprobs(
    raw: jax.Array,
    processed: jax.Array,
    token_ids: jax.Array,
    rows: SamplingRows,
    *,
    num_logprobs: int,
    mode: str,
) -> SamplerOutput:
    """The sampled tokens with their logprobs (``mode``: one of ``LOGPROBS_MODES``), computed
    only when some row asks; K = ``num_logprobs`` columns for every row (each keeps its own)."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    num_rows = token_ids.shape[0]
    k = min(num_logprobs, raw.shape[1])

    def compute(_):
        source = raw if mode.startswith("raw") else processed
        lp, rank, ids, lps = compute_logprobs(
            source, token_ids, k, normalize=mode.endswith("logprobs")
        )
        return (
            jnp.concatenate([lp[:, None], lps], axis=-1),
            jnp.concatenate([token_ids[:, None], ids], axis=-1),
            rank,
        )

    def skip(_):
        return (
            jnp.zeros((num_rows, k + 1), jnp.float32),
            jnp.zeros((num_rows, k + 1), jnp.int32),
            jnp.zeros((num_rows,), jnp.int32),
        )

    logprobs, ids, rank = lax.cond(jnp.any(rows.num_logprobs >= 0), compute, skip, None)
    return SamplerOutput(token_ids, logprobs, ids, rank)


def sample(
    logits: jax.Array,  # [S, V] float (one row per request row)
    rows: SamplingRows,
    *,
    num_logprobs: int,  # static K: logprob columns (the engine's max_logprobs)
    logprobs_mode: str = "raw_logprobs",  # static, one of LOGPROBS_MODES
) -> SamplerOutput:
    """Samples one token per row (see the module docstring for the order). Jittable."""
    raw = logits.astype(jnp.float32)
    processed = processed_logits(raw, rows)
    greedy_ids = argmax(processed)  # greedy: exact argmax
    temperature = rows.get("temperature")
    is_random = temperature >= SAMPLING_EPS

    def draw(_):
        scaled = scaled_logits(processed, rows)
        drawn = random_sample(scaled, rows.get("key_data"), rows.num_output_tokens)
        return jnp.where(is_random, drawn, greedy_ids), scaled

    # greedy rows' distribution: temperature 1, untruncated
    token_ids, scaled = lax.cond(jnp.any(is_random), draw, lambda _: (greedy_ids, processed), None)
    return _with_logprobs(
        raw, scaled, token_ids, rows, num_logprobs=num_logprobs, mode=logprobs_mode
    )


def sample_and_verify(
    logits: jax.Array,  # [P, V] float: one row per scored position
    rows: SamplingRows,  # P positions: each one's request slot, ``num_output_tokens`` its own
    draft_ids: jax.Array,  # [P] int32: the draft token at the position, PAD for none
    *,
    num_logprobs: int,
    logprobs_mode: str = "raw_logprobs",
) -> tuple[SamplerOutput, jax.Array]:  # (tokens [P], accepted [P] bool)
    """Speculative sampling against drafts that came with no probabilities (n-gram drafts,
    i.e. a draft distribution q that is one-hot on the draft d).

    Per position: greedy rows take the argmax and accept the draft when it is that argmax.
    Random rows accept d with probability p(d) (p: the processed, scaled distribution; a
    uniform drawn from the position's own key); on rejection they draw from p with d removed
    (the residual ``max(p - q, 0)`` normalised). Positions without a draft draw from p as
    :func:`sample` does. The caller keeps each row's tokens up to and including the first
    position that did not accept: the output then follows p exactly (standard speculative
    sampling), and greedy outputs equal non-speculative ones.
    """
    raw = logits.astype(jnp.float32)
    processed = processed_logits(raw, rows)
    greedy_ids = argmax(processed)
    has_draft = draft_ids >= 0
    is_random = rows.get("temperature") >= SAMPLING_EPS

    def draw(_):
        scaled = scaled_logits(processed, rows)
        keys = request_keys(rows.get("key_data"), rows.num_output_tokens)
        p_draft = jnp.take_along_axis(
            jax.nn.softmax(scaled, axis=-1), jnp.maximum(draft_ids, 0)[:, None], axis=-1
        )[:, 0]  # [P]
        uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)  # [P]
        take_draft = has_draft & (uniform < p_draft)
        is_draft = has_draft[:, None] & (jnp.arange(scaled.shape[1])[None, :] == draft_ids[:, None])
        # p without the draft; at positions without one it is p itself (the plain draw)
        drawn = random_sample(
            jnp.where(is_draft, -jnp.inf, scaled), rows.get("key_data"), rows.num_output_tokens
        )
        random_ids = jnp.where(take_draft, draft_ids, drawn)
        return (
            jnp.where(is_random, random_ids, greedy_ids),
            jnp.where(is_random, take_draft, has_draft & (greedy_ids == draft_ids)),
            scaled,
        )

    def greedy(_):
        return greedy_ids, has_draft & (greedy_ids == draft_ids), processed

    token_ids, accepted, scaled = lax.cond(jnp.any(is_random), draw, greedy, None)
    out = _with_logprobs(
        raw, scaled, token_ids, rows, num_logprobs=num_logprobs, mode=logprobs_mode
    )
    return out, accepted


def sample_greedy_vocab_major(logits_t: jax.Array) -> jax.Array:  # [V, S] float -> [S] int32
    """The greedy program's sampler: the first maximum of each column (first NaN if any), for
    steps whose sampling rows all take the argmax of their raw logits (no row needs
    processing: ``jaxkv.worker.sampling_updates.needs_processing``). The logits come
    vocab-major, ``[V, S]``: the faster LM-head GEMM orientation on XLA:CPU."""
    return argmax(logits_t.astype(jnp.float32), axis=0)
