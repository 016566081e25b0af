"""The sampler: logits of the last token of each request row -> next token ids (+ logprobs).

Everything here runs on the device inside the jitted step. The per-row inputs come in one
:class:`~jaxkv.worker.sampling_metadata.SamplingMetadata` pytree built on the host by
:func:`~jaxkv.worker.sampling_metadata.build_sampling_metadata`.

Shape names: ``S`` request rows (padded to a bucket), ``V`` vocab size, ``K`` number of top
logprobs, ``W`` the width of the penalty history (prompt then output tokens), ``Lb`` / ``La``
/ ``Lz`` the padded lengths of the banned-token, allowed-token and logit-bias lists, ``Bw`` the
number of bad words per row and ``R`` the longest bad word's length less one.

Order of operations (vLLM V1 ``Sampler.forward``):
  1. logprobs, if requested, from the *raw* logits (vLLM's default ``logprobs_mode =
     "raw_logprobs"``: before bans, penalties, temperature and truncation; ``LOGPROBS_MODES``
     lists the others: the raw logits themselves, or the processed distribution a row samples
     from, after step 5, as logprobs or logits);
  2. ``allowed_token_ids``: every other token -> -inf; ``logit_bias`` added; banned tokens ->
     -inf (min_tokens: EOS and stop ids before ``min_tokens`` outputs; bad words: a word's last
     token when the row's latest outputs are the rest of the word);
  3. penalties: repetition (tokens in prompt or output), frequency and presence (output);
  4. greedy rows (``temperature < SAMPLING_EPS``) take the argmax of these logits, exactly;
  5. temperature, then min_p, then top_k / top_p (one sort per row), then a Gumbel-max draw.

Randomness is per request, never batch-wide: row ``i`` draws with
``fold_in(key_i, num_output_tokens_i)`` where ``key_i`` is the request's own key (from its
``seed``, or from the engine seed and the request id). A seeded request therefore gets the same
tokens alone or at any row of any batch, and after a preemption.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.sampling_params import SAMPLING_EPS
from jaxkv.worker.sampling_metadata import PAD_TOKEN_ID, SamplingMetadata

#: PRNG implementation of the per-request key data ([2] uint32 per request).
PRNG_IMPL = "threefry2x32"

#: vLLM's ``logprobs_mode`` values: what the reported logprobs are computed from. "raw_*": the
#: model's logits; "processed_*": the logits the row samples from (allow-lists, bias, bans,
#: penalties, then temperature, min_p, top-k / top-p; greedy rows at temperature 1, untruncated),
#: masked tokens -inf. "*_logprobs" normalises them (log-softmax), "*_logits" reports them as is.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and, when ``max_num_logprobs`` is not None, their logprobs."""

    sampled_token_ids: jax.Array        # [S] int32
    logprobs: jax.Array | None          # [S, K + 1] float32: sampled token first, then the top K
    logprob_token_ids: jax.Array | None  # [S, K + 1] int32, token ids of ``logprobs``
    sampled_rank: jax.Array | None      # [S] int32, 1-based rank of the sampled token (raw logits)


jax.tree_util.register_dataclass(
    SamplerOutput,
    data_fields=["sampled_token_ids", "logprobs", "logprob_token_ids", "sampled_rank"],
    meta_fields=[],
)


# ---- logprobs ------------------------------------------------------------------------------


def compute_logprobs(
    logits: jax.Array,      # [P, V] float, raw logits (one row per position)
    target_ids: jax.Array,  # [P] int32, the token whose logprob and rank are wanted
    num_logprobs: int,      # static K >= 0
    *, normalize: bool = True,   # static: False reports the logits themselves
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprob and rank of ``target_ids`` plus the top-K logprobs of each row.

    Usable for sampled tokens and for prompt positions (targets = the next prompt token).
    ``rank`` is vLLM's: the number of tokens whose logprob is >= the target's (1 = most likely;
    ties share the worse rank).

    Returns:
      target_logprob [P] float32, rank [P] int32, topk_ids [P, K] int32,
      topk_logprobs [P, K] float32 (descending).
    """
    logprobs = logits.astype(jnp.float32)                                # [P, V]
    if normalize:
        logprobs = jax.nn.log_softmax(logprobs, axis=-1)
    target_ids = target_ids.astype(jnp.int32)
    target_logprob = jnp.take_along_axis(logprobs, target_ids[:, None], axis=-1)[:, 0]  # [P]
    rank = jnp.sum(logprobs >= target_logprob[:, None], axis=-1, dtype=jnp.int32)  # [P]
    # K is a bucket (a power of two) and may pass the vocabulary: every token is then in it
    topk_logprobs, topk_ids = jax.lax.top_k(logprobs, min(num_logprobs, logprobs.shape[-1]))  # [P, K]
    return target_logprob, rank, topk_ids.astype(jnp.int32), topk_logprobs


# ---- logits processing ---------------------------------------------------------------------


def _token_counts(
    token_ids: jax.Array,  # [S, L] int32, PAD_TOKEN_ID-padded
    vocab_size: int,
    *,
    presence_only: bool = False,
) -> jax.Array:            # [S, V] int32 counts, or bool presence when presence_only
    """Per-row bincount of token ids on the device (padding entries are dropped)."""
    rows = jnp.broadcast_to(jnp.arange(token_ids.shape[0])[:, None], token_ids.shape)
    cols = jnp.where(token_ids < 0, vocab_size, token_ids)  # pad -> out of range -> dropped
    if presence_only:
        seen = jnp.zeros((token_ids.shape[0], vocab_size), jnp.bool_)
        return seen.at[rows, cols].set(True, mode="drop")
    counts = jnp.zeros((token_ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, cols].add(1, mode="drop")


def apply_banned_tokens(
    logits: jax.Array,     # [S, V] float32 ([V, S] when vocab_major)
    banned_ids: jax.Array,  # [S, Lb] int32, PAD_TOKEN_ID-padded
    *, vocab_major: bool = False,
) -> jax.Array:            # same shape as logits
    """Sets banned tokens to -inf (a no-op when Lb == 0)."""
    if banned_ids.shape[1] == 0:
        return logits
    rows = jnp.broadcast_to(jnp.arange(banned_ids.shape[0])[:, None], banned_ids.shape)
    cols = jnp.where(banned_ids < 0, logits.shape[0 if vocab_major else 1], banned_ids)
    index = (cols, rows) if vocab_major else (rows, cols)
    return logits.at[index].set(-jnp.inf, mode="drop")


def bad_word_bans(
    prefix_ids: jax.Array,   # [S, Bw, R] int32, right-aligned, PAD_TOKEN_ID on the left
    last_ids: jax.Array,     # [S, Bw] int32, PAD_TOKEN_ID for no word
    recent_ids: jax.Array,   # [S, R] int32, last R host-known outputs, PAD_TOKEN_ID on the left
    pending_ids: jax.Array,  # [S] int32, an output token newer than those, or PAD_TOKEN_ID
) -> jax.Array:              # [S, Bw] int32: tokens to ban this step, PAD_TOKEN_ID elsewhere
    """vLLM's bad words: a word's last token is banned when the row's latest output tokens
    equal the rest of the word; a one-token word is always banned.

    The latest R outputs are ``recent_ids`` shifted left by one with the pending token
    appended when there is one (async scheduling: the step in flight sampled it). A row with
    fewer outputs than a word's prefix has padding there, which matches no token.
    """
    if last_ids.shape[1] == 0 or prefix_ids.shape[2] == 0:
        return last_ids
    latest = jnp.concatenate([recent_ids[:, 1:], pending_ids[:, None]], axis=1)      # [S, R]
    latest = jnp.where(pending_ids[:, None] >= 0, latest, recent_ids)
    match = jnp.all((prefix_ids < 0) | (prefix_ids == latest[:, None, :]), axis=2)   # [S, Bw]
    return jnp.where(match, last_ids, PAD_TOKEN_ID)


def _banned_this_step(md: SamplingMetadata) -> jax.Array:  # [S, Lb + Bw] int32
    """min_tokens' bans and the bad words that match the row's latest outputs."""
    words = bad_word_bans(md.bad_word_prefix_ids, md.bad_word_last_ids, md.recent_output_ids,
                          md.pending_token_ids)
    return jnp.concatenate([md.banned_token_ids, words], axis=1)


def apply_allowed_tokens(
    logits: jax.Array,       # [S, V] float32
    allowed_ids: jax.Array,  # [S, La] int32, PAD_TOKEN_ID-padded
) -> jax.Array:              # [S, V] float32
    """Rows with an allow-list keep only those tokens (the rest -> -inf); rows without one (all
    padding), and every row when La == 0, are unchanged."""
    if allowed_ids.shape[1] == 0:
        return logits
    rows = jnp.broadcast_to(jnp.arange(allowed_ids.shape[0])[:, None], allowed_ids.shape)
    cols = jnp.where(allowed_ids < 0, logits.shape[1], allowed_ids)
    allowed = jnp.zeros(logits.shape, jnp.bool_).at[rows, cols].set(True, mode="drop")
    has_list = jnp.any(allowed_ids >= 0, axis=1, keepdims=True)               # [S, 1]
    return jnp.where(has_list & ~allowed, -jnp.inf, logits)


def apply_logit_bias(
    logits: jax.Array,    # [S, V] float32
    bias_ids: jax.Array,  # [S, Lz] int32, PAD_TOKEN_ID-padded
    bias: jax.Array,      # [S, Lz] float32
) -> jax.Array:           # [S, V] float32
    """Adds each row's ``logit_bias`` to its tokens (a no-op when Lz == 0)."""
    if bias_ids.shape[1] == 0:
        return logits
    rows = jnp.broadcast_to(jnp.arange(bias_ids.shape[0])[:, None], bias_ids.shape)
    cols = jnp.where(bias_ids < 0, logits.shape[1], bias_ids)
    return logits.at[rows, cols].add(bias.astype(jnp.float32), mode="drop")


def apply_penalties(
    logits: jax.Array,              # [S, V] float32
    history_token_ids: jax.Array,   # [S, W] int32: prompt, then output tokens
    num_prompt_tokens: jax.Array,   # [S] int32
    num_history_tokens: jax.Array,  # [S] int32: columns >= this are ignored
    pending_token_ids: jax.Array,   # [S] int32: one more output token, or PAD_TOKEN_ID
    presence_penalty: jax.Array,    # [S] float32
    frequency_penalty: jax.Array,   # [S] float32
    repetition_penalty: jax.Array,  # [S] float32
) -> jax.Array:                     # [S, V] float32
    """vLLM's penalties.

    For a token seen in the prompt or the output, repetition divides a positive logit by
    ``repetition_penalty`` and multiplies a non-positive one; then, for a token seen ``c > 0``
    times in the output, ``logit -= c * frequency_penalty + presence_penalty``.
    """
    vocab = logits.shape[1]
    col = jnp.arange(history_token_ids.shape[1], dtype=jnp.int32)[None, :]          # [1, W]
    known = col < num_history_tokens[:, None]
    in_prompt_col = col < num_prompt_tokens[:, None]
    prompt_ids = jnp.where(known & in_prompt_col, history_token_ids, PAD_TOKEN_ID)   # [S, W]
    output_ids = jnp.where(known & ~in_prompt_col, history_token_ids, PAD_TOKEN_ID)  # [S, W]
    output_ids = jnp.concatenate([output_ids, pending_token_ids[:, None]], axis=1)  # [S, W + 1]
    output_counts = _token_counts(output_ids, vocab)                               # [S, V] int32
    in_prompt = _token_counts(prompt_ids, vocab, presence_only=True)               # [S, V] bool
    in_output = output_counts > 0                                                  # [S, V] bool
    rep = repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(in_prompt | in_output, repeated, logits)
    logits = logits - frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - presence_penalty[:, None] * in_output.astype(jnp.float32)


def apply_min_p(
    logits: jax.Array,  # [S, V] float32, temperature already applied
    min_p: jax.Array,   # [S] float32
) -> jax.Array:         # [S, V] float32
    """Masks tokens with ``p < min_p * p_max``, i.e. ``logit < logit_max + log(min_p)``.

    The comparison is done on logits (no softmax): the two tests are the same because the
    softmax normaliser cancels. ``min_p = 0`` gives ``log 0 = -inf`` and keeps everything.
    """
    threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits < threshold, -jnp.inf, logits)


def apply_top_k_top_p(
    logits: jax.Array,  # [S, V] float32, temperature already applied
    top_k: jax.Array,   # [S] int32, 0 = off
    top_p: jax.Array,   # [S] float32, 1 = off
) -> jax.Array:         # [S, V] float32
    """Keeps the top_k most likely tokens, then the smallest prefix of them holding top_p mass.

    One descending sort per row. A token stays if it is among the first ``top_k`` and the
    probability mass (over those ``top_k``) strictly before it is < ``top_p``; at least one
    token always stays. The kept set is a prefix of the sorted row, so the mask is a threshold
    on the logit of its last element (ties with that element are kept, as in vLLM's top-k).

    Example: probs [0.5, 0.3, 0.15, 0.05] with top_p 0.7: mass before each token is
    [0, 0.5, 0.8, 0.95] -> the first two stay.
    """
    vocab = logits.shape[1]
    sorted_desc = jnp.sort(logits, axis=-1, descending=True)                  # [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)                # [S]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]                        # [S, V]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                          # [S, V]
    # top_p >= 1 keeps everything explicitly: a float32 cumsum can reach 1 before the tail.
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)                         # [S]
    threshold = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)  # [S, 1]
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _argmax_chunk(vocab: int) -> int | None:
    """Chunk width for ``argmax``: a divisor of ``vocab`` in [64, 512] nearest 256, else None."""
    divisors = [c for c in range(64, 513) if vocab % c == 0 and vocab // c > 1]
    return min(divisors, key=lambda c: abs(c - 256)) if divisors else None


def _first_true(hit: jax.Array, axis: int) -> jax.Array:  # bool -> int32, ``axis`` removed
    """Index of the first True along ``axis`` (its length where there is none)."""
    iota = lax.broadcasted_iota(jnp.int32, hit.shape, axis)
    return jnp.min(jnp.where(hit, iota, hit.shape[axis]), axis=axis)


def _argmax_exact(x: jax.Array, axis: int) -> jax.Array:
    """First NaN along ``axis`` if there is one, else the first maximum (max and NaN taken
    apart: a vectorised max does not propagate NaN from every position)."""
    nan = jnp.isnan(x)
    m = jnp.max(jnp.where(nan, -jnp.inf, x), axis=axis, keepdims=True)
    return _first_true(jnp.where(jnp.any(nan, axis=axis, keepdims=True), nan, x == m), axis)


def argmax(x: jax.Array, axis: int = -1) -> jax.Array:  # [..., V] -> [...] int32 (V at ``axis``)
    """``jnp.argmax(x, axis)`` (first maximum; first NaN if any) with plain reductions.

    XLA:CPU lowers jnp.argmax to a variadic (value, index) reduce that does not vectorise, and
    "max, then first index of the max" over [S, V] takes several passes. So the vocabulary is
    cut into chunks of c: one pass takes each chunk's max, the first chunk holding the overall
    max is found among those, and only that chunk is searched. A batch with a NaN or inf
    anywhere (a non-finite row sum) takes the exact multi-pass path instead. Measured after a
    [64, 512] x [512, 32000] LM head (2 cores): +0.8 ms vs +2.9 ms for max-then-first-index.
    """
    axis = axis % x.ndim
    vocab = x.shape[axis]
    c = _argmax_chunk(vocab)
    if c is None:
        return _argmax_exact(x, axis)
    n = vocab // c
    y = x.reshape(x.shape[:axis] + (n, c) + x.shape[axis + 1:])            # V -> (n, c)
    chunk_max = jnp.max(y, axis=axis + 1)                                   # n at ``axis``
    m = jnp.max(chunk_max, axis=axis, keepdims=True)                        # 1 at ``axis``
    ci = jnp.minimum(_first_true(chunk_max == m, axis), n - 1)              # ``axis`` removed
    block = jnp.take_along_axis(y, jnp.expand_dims(ci, (axis, axis + 1)), axis=axis)
    block = jnp.squeeze(block, axis)                                        # c at ``axis``
    fast = ci * c + jnp.minimum(_first_true(block == m, axis), c - 1)
    # A NaN or inf anywhere makes the sum non-finite (a sum, unlike a vectorised max, always
    # propagates NaN); such batches take the exact path.
    finite = jnp.all(jnp.isfinite(jnp.sum(y, axis=(axis, axis + 1))))
    return lax.cond(finite, lambda _: fast, lambda v: _argmax_exact(v, axis), x)


def _request_keys(
    key_data: jax.Array,           # [S, 2] uint32
    num_output_tokens: jax.Array,  # [S] int32
) -> jax.Array:                    # [S] typed PRNG keys
    keys = jax.random.wrap_key_data(key_data.astype(jnp.uint32), impl=PRNG_IMPL)
    return jax.vmap(jax.random.fold_in)(keys, num_output_tokens.astype(jnp.uint32))


def random_sample(
    logits: jax.Array,             # [S, V] float32, processed (temperature, truncation)
    key_data: jax.Array,           # [S, 2] uint32
    num_output_tokens: jax.Array,  # [S] int32
) -> jax.Array:                    # [S] int32
    """Gumbel-max draw from ``softmax(logits)`` with each row's own key."""
    keys = _request_keys(key_data, num_output_tokens)
    vocab = logits.shape[1]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)  # [S, V]
    return argmax(logits + gumbel)


# ---- the sampler ---------------------------------------------------------------------------


def _processed_logits(
    logits: jax.Array,  # [S, V] float32
    md: SamplingMetadata,
) -> jax.Array:         # [S, V] float32: what greedy rows take the argmax of
    """Allow-lists, logit bias, bans (min_tokens, bad words) and penalties (steps 2-3)."""
    logits = apply_allowed_tokens(logits, md.allowed_token_ids)
    logits = apply_logit_bias(logits, md.bias_token_ids, md.bias_values)
    logits = apply_banned_tokens(logits, _banned_this_step(md))
    if md.use_penalties:
        logits = apply_penalties(
            logits, md.history_token_ids, md.num_prompt_tokens, md.num_history_tokens,
            md.pending_token_ids, md.presence_penalty, md.frequency_penalty, md.repetition_penalty,
        )
    return logits


def _scaled_logits(
    logits: jax.Array,  # [S, V] float32, processed
    md: SamplingMetadata,
) -> jax.Array:         # [S, V] float32: the distribution random rows draw from (step 5)
    """Temperature (1 for greedy rows), then min_p, then top_k / top_p."""
    temperature = jnp.where(md.temperature < SAMPLING_EPS, 1.0, md.temperature)
    scaled = apply_min_p(logits / temperature[:, None], md.min_p)
    if md.use_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p)
    return scaled


def _with_logprobs(raw_logits: jax.Array,   # [S, V] float32, the model's
                   processed: jax.Array,    # [S, V] float32, what the rows sample from
                   token_ids: jax.Array, md: SamplingMetadata, mode: str) -> SamplerOutput:
    """The sampled tokens with their logprobs (``mode``: one of ``LOGPROBS_MODES``)."""
    if md.max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    source = raw_logits if mode.startswith("raw") else processed
    token_logprob, rank, topk_ids, topk_logprobs = compute_logprobs(
        source, token_ids, md.max_num_logprobs, normalize=mode.endswith("logprobs")
    )
    return SamplerOutput(
        sampled_token_ids=token_ids,
        logprobs=jnp.concatenate([token_logprob[:, None], topk_logprobs], axis=-1),
        logprob_token_ids=jnp.concatenate([token_ids[:, None], topk_ids], axis=-1),
        sampled_rank=rank,
    )


def sample(
    logits: jax.Array,       # [S, V] float (one row per request row)
    md: SamplingMetadata,
    *, logprobs_mode: str = "raw_logprobs",   # static, one of LOGPROBS_MODES
) -> SamplerOutput:
    """Samples one token per row (see the module docstring for the order). Jittable."""
    raw_logits = logits.astype(jnp.float32)
    logits = _processed_logits(raw_logits, md)
    token_ids = argmax(logits)  # greedy: exact argmax
    scaled = logits             # greedy rows' distribution: temperature 1, untruncated
    if not md.all_greedy:
        scaled = _scaled_logits(logits, md)
        random_ids = random_sample(scaled, md.key_data, md.num_output_tokens)
        token_ids = jnp.where(md.temperature < SAMPLING_EPS, token_ids, random_ids)
    return _with_logprobs(raw_logits, scaled, token_ids, md, logprobs_mode)


def sample_and_verify(
    logits: jax.Array,     # [P, V] float: one row per scored position
    md: SamplingMetadata,  # P rows: each position's request row, ``num_output_tokens`` its own
    draft_ids: jax.Array,  # [P] int32: the draft token at the position, PAD_TOKEN_ID for none
    *, logprobs_mode: str = "raw_logprobs",   # static, one of LOGPROBS_MODES
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
    raw_logits = logits.astype(jnp.float32)
    logits = _processed_logits(raw_logits, md)
    greedy_ids = argmax(logits)
    has_draft = draft_ids >= 0
    accepted = has_draft & (greedy_ids == draft_ids)
    token_ids = greedy_ids
    scaled = logits             # greedy rows' distribution: temperature 1, untruncated
    if not md.all_greedy:
        is_greedy = md.temperature < SAMPLING_EPS
        scaled = _scaled_logits(logits, md)
        keys = _request_keys(md.key_data, md.num_output_tokens)
        p_draft = jnp.take_along_axis(jax.nn.softmax(scaled, axis=-1),
                                      jnp.maximum(draft_ids, 0)[:, None], axis=-1)[:, 0]   # [P]
        uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)     # [P]
        take_draft = has_draft & (uniform < p_draft)
        is_draft = has_draft[:, None] & (jnp.arange(scaled.shape[1])[None, :] == draft_ids[:, None])
        # p without the draft; at positions without one it is p itself (the plain draw)
        drawn = random_sample(jnp.where(is_draft, -jnp.inf, scaled), md.key_data, md.num_output_tokens)
        random_ids = jnp.where(take_draft, draft_ids, drawn)
        token_ids = jnp.where(is_greedy, greedy_ids, random_ids)
        accepted = jnp.where(is_greedy, accepted, take_draft)
    return _with_logprobs(raw_logits, scaled, token_ids, md, logprobs_mode), accepted


def greedy_vocab_major(md: SamplingMetadata) -> bool:
    """Static: whether ``sample`` reduces to an argmax over the vocabulary (every row greedy;
    no penalties, logprobs, allow-lists or logit biases), so the step may hand
    ``sample_greedy_vocab_major`` the logits transposed, ``[V, S]`` (the faster LM-head GEMM
    orientation on XLA:CPU)."""
    return (md.all_greedy and not md.use_penalties and md.max_num_logprobs is None
            and md.allowed_token_ids.shape[1] == 0 and md.bias_token_ids.shape[1] == 0)


def sample_greedy_vocab_major(
    logits_t: jax.Array,  # [V, S] float (column s: row s's logits)
    md: SamplingMetadata,
) -> SamplerOutput:
    """``sample(logits_t.T, md)`` for metadata where ``greedy_vocab_major(md)``: banned tokens
    set to -inf, then the first maximum of each column (first NaN if any)."""
    if not greedy_vocab_major(md):
        raise ValueError("sample_greedy_vocab_major needs all-greedy metadata without penalties "
                         "or logprobs")
    logits_t = apply_banned_tokens(logits_t.astype(jnp.float32), _banned_this_step(md),
                                   vocab_major=True)
    return SamplerOutput(argmax(logits_t, axis=0), None, None, None)
