"""Glue between the jitted step and the sampler: device functions and host-side unpacking.

The step returns flat dicts of arrays (packed into one int32 array); these helpers produce
them on the device and turn the fetched rows into ``TokenLogprobs`` on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.worker.buckets import pow2_at_least
from jaxkv.worker.sampling_metadata import PAD_TOKEN_ID
from jaxkv.worker.sampler import (compute_logprobs, greedy_vocab_major, sample, sample_and_verify,
                                  sample_greedy_vocab_major)


def sample_fn(logits_fn, md, *, logprobs_mode: str = "raw_logprobs") -> dict:
    """Samples from ``logits_fn(vocab_major)`` (-> [S, V], or [V, S] when ``vocab_major``):
    {"sampled_token_ids": [S], and [S, K+1] logprobs when asked (``logprobs_mode``, static:
    see ``sampler.LOGPROBS_MODES``)}. All-greedy metadata without penalties or logprobs takes
    the logits vocab-major (the faster LM head on XLA:CPU)."""
    if greedy_vocab_major(md):
        out = sample_greedy_vocab_major(logits_fn(True), md)
    else:
        out = sample(logits_fn(False), md, logprobs_mode=logprobs_mode)
    return _result(out)


def spec_sample_fn(logits_fn, md, draft_ids, *, logprobs_mode: str = "raw_logprobs") -> dict:
    """``sample_fn`` over P scored positions with drafts ([P] int32, -1: none): also
    {"spec_accepted": [P] bool} (see ``sampler.sample_and_verify``)."""
    out, accepted = sample_and_verify(logits_fn(False), md, draft_ids, logprobs_mode=logprobs_mode)
    return dict(_result(out), spec_accepted=accepted)


def gather_rows(md, rows, offsets, drafts, *, max_drafts: int):
    """Sampling metadata of S rows -> P scored positions (speculative decoding).

    Position p takes row ``rows[p]`` ([P] int32) and samples its output number
    ``num_output_tokens + offsets[p]`` ([P] int32; the key folds that in). It follows the
    row's drafts before it (``drafts`` [P] int32: the draft each position checks, so position
    p's predecessors are ``drafts[p - offsets[p] : p]``), so the penalties count them as
    outputs and bad words match them as the latest outputs: the position sees the history it
    would have if they are accepted (and its result is dropped if one is not). min_tokens'
    bans hold only at the positions before the row's ``min_tokens``-th output.
    ``max_drafts`` (static) bounds ``offsets``.
    """
    md = jax.tree_util.tree_map(lambda a: a[rows], md)
    md = dataclasses.replace(md, num_output_tokens=md.num_output_tokens + offsets)
    if md.banned_token_ids.shape[1]:   # min_tokens: positions past the row's last banned output are free
        md = dataclasses.replace(md, banned_token_ids=jnp.where(
            offsets[:, None] < md.num_banned_outputs[:, None], md.banned_token_ids, PAD_TOKEN_ID))
    bad_words = md.bad_word_last_ids.shape[1] > 0 and md.recent_output_ids.shape[1] > 0
    if max_drafts == 0 or not (md.use_penalties or bad_words):
        return md
    num_pos = rows.shape[0]
    i = jnp.arange(max_drafts, dtype=jnp.int32)[None, :]                      # [1, k]
    earlier = i < offsets[:, None]                                           # [P, k]
    src = jnp.clip(jnp.arange(num_pos, dtype=jnp.int32)[:, None] - offsets[:, None] + i, 0, num_pos - 1)
    before = jnp.where(earlier, drafts[src], PAD_TOKEN_ID)                   # [P, k] drafts before p
    if md.use_penalties:
        width = md.history_token_ids.shape[1] + max_drafts
        history = jnp.concatenate(
            [md.history_token_ids, jnp.full((num_pos, max_drafts), PAD_TOKEN_ID, jnp.int32)], axis=1)
        cols = jnp.where(earlier, md.num_history_tokens[:, None] + i, width)   # [P, k]; width: dropped
        history = history.at[jnp.arange(num_pos)[:, None], cols].set(before, mode="drop")
        md = dataclasses.replace(md, history_token_ids=history,
                                 num_history_tokens=md.num_history_tokens + offsets)
    if bad_words:   # the latest R outputs: the host's R, then the drafts before p
        r = md.recent_output_ids.shape[1]
        latest = jnp.concatenate([md.recent_output_ids, before], axis=1)       # [P, R + k]
        window = offsets[:, None] + jnp.arange(r, dtype=jnp.int32)[None, :]    # [P, R]
        md = dataclasses.replace(md, recent_output_ids=jnp.take_along_axis(latest, window, axis=1))
    return md


def _result(out) -> dict:
    result = {"sampled_token_ids": out.sampled_token_ids.astype(jnp.int32)}
    if out.logprobs is not None:
        result.update(logprobs=out.logprobs.astype(jnp.float32),
                      logprob_token_ids=out.logprob_token_ids.astype(jnp.int32),
                      sampled_rank=out.sampled_rank.astype(jnp.int32))
    return result


def prompt_logprobs_fn(logits, targets, k: int) -> dict:
    """logits [T, V], targets [T] int32 (-1: no target) -> per-token logprob, rank and top-k."""
    lp, rank, ids, lps = compute_logprobs(logits, jnp.maximum(targets, 0), k)
    return {"prompt_lp": lp, "prompt_rank": rank, "prompt_topk_ids": ids, "prompt_topk_lp": lps}


def row_logprobs(results: dict, row: int, k: int) -> tuple[list[int], list[float], list[int]]:
    """The sampled token's TokenLogprobs: (ids, logprobs, ranks), sampled token first, then top k."""
    ids = results["logprob_token_ids"][row, : k + 1].tolist()
    lps = results["logprobs"][row, : k + 1].tolist()
    ranks = [int(results["sampled_rank"][row])] + list(range(1, k + 1))
    return ids, lps, ranks


def prompt_row(results: dict, token: int, target: int, k: int) -> tuple[list[int], list[float], list[int]]:
    """TokenLogprobs of one prompt position: its target (the next prompt token), then top k."""
    ids = [int(target)] + results["prompt_topk_ids"][token, :k].tolist()
    lps = [float(results["prompt_lp"][token])] + results["prompt_topk_lp"][token, :k].tolist()
    ranks = [int(results["prompt_rank"][token])] + list(range(1, k + 1))
    return ids, lps, ranks


def bucket_k(k: int) -> int:
    """Top-k sizes are rounded to powers of two (few compiles); rows keep their own first k."""
    return 0 if k <= 0 else pow2_at_least(k)
