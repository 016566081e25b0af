"""Glue between the jitted step and the sampler: device functions and host-side unpacking.

The step returns flat dicts of arrays (packed into one int32 array); these helpers produce
them on the device and turn the fetched rows into ``TokenLogprobs`` on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.worker.buckets import pow2_at_least
from jaxkv.worker.sampler import (compute_logprobs, greedy_vocab_major, sample, sample_and_verify,
                                  sample_greedy_vocab_major)


def sample_fn(logits_fn, md) -> dict:
    """Samples from ``logits_fn(vocab_major)`` (-> [S, V], or [V, S] when ``vocab_major``):
    {"sampled_token_ids": [S], and [S, K+1] logprobs when asked}. All-greedy metadata without
    penalties or logprobs takes the logits vocab-major (the faster LM head on XLA:CPU)."""
    if greedy_vocab_major(md):
        out = sample_greedy_vocab_major(logits_fn(True), md)
    else:
        out = sample(logits_fn(False), md)
    return _result(out)


def spec_sample_fn(logits_fn, md, draft_ids) -> dict:
    """``sample_fn`` over P scored positions with drafts ([P] int32, -1: none): also
    {"spec_accepted": [P] bool} (see ``sampler.sample_and_verify``)."""
    out, accepted = sample_and_verify(logits_fn(False), md, draft_ids)
    return dict(_result(out), spec_accepted=accepted)


def gather_rows(md, rows, offsets):
    """Sampling metadata of S rows -> P positions: position p takes row ``rows[p]`` ([P]
    int32) and counts ``offsets[p]`` more outputs (its key folds in the output index it
    samples)."""
    md = jax.tree_util.tree_map(lambda a: a[rows], md)
    return dataclasses.replace(md, num_output_tokens=md.num_output_tokens + offsets)


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
