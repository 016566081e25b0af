"""Sampler test helpers: a device SamplingState written from SamplingParams, and the rows that
read it, built exactly as the runner builds them (``build_updates`` + ``apply_update``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.worker.sampler import SamplingRows
from jaxkv.worker.sampling_state import (
    PAD_TOKEN_ID,
    SamplingStateUpdate,
    allocate_state,
    apply_update,
)
from jaxkv.worker.sampling_updates import SlotInit, build_updates, make_request_key

V = 32
MAX_LEN = 64
_apply = jax.jit(apply_update, donate_argnums=0)


def write_state(
    params,
    *,
    prompts=None,
    outputs=None,
    seeds=None,
    eos_token_id=None,
    vocab=V,
    max_len=MAX_LEN,
    num_slots=None,
    entries=64,
):
    """A SamplingState of ``num_slots`` slots (+ the neutral one) with ``params[i]`` in slot i."""
    n = len(params)
    num_slots = num_slots or max(n, 1)
    prompts = prompts if prompts is not None else [[]] * n
    outputs = outputs if outputs is not None else [[]] * n
    seeds = seeds or [p.seed or 0 for p in params]
    inits = [
        SlotInit(
            slot=i,
            params=p,
            key_data=make_request_key(s),
            token_ids=list(pr) + list(o),
            num_prompt_tokens=len(pr),
        )
        for i, (p, pr, o, s) in enumerate(zip(params, prompts, outputs, seeds))
    ]
    state = allocate_state(num_slots + 1, vocab, max_len)
    for update in build_updates(
        inits, num_updates=num_slots, num_entries=entries, eos_token_id=eos_token_id
    ):
        state = _apply(state, SamplingStateUpdate(**{k: jnp.asarray(v) for k, v in update.items()}))
    return state


def rows(
    params,
    *,
    steps=None,
    prompts=None,
    outputs=None,
    num_rows=None,
    seeds=None,
    eos_token_id=None,
    prior_drafts=None,
    vocab=V,
    entries=64,
) -> SamplingRows:
    """The SamplingRows of ``params`` (row i in slot i), padded to ``num_rows`` with the neutral
    slot. ``steps``: each row's outputs so far (default: its ``outputs``' length)."""
    n = len(params)
    num_rows = num_rows or n
    prompts = prompts if prompts is not None else [[]] * n
    outputs = outputs if outputs is not None else [[]] * n
    state = write_state(
        params,
        prompts=prompts,
        outputs=outputs,
        seeds=seeds,
        eos_token_id=eos_token_id,
        vocab=vocab,
        num_slots=num_rows,
        entries=entries,
    )
    slots = np.full(num_rows, state.neutral_slot, np.int32)
    slots[:n] = np.arange(n)
    num_out = np.zeros(num_rows, np.int32)
    num_out[:n] = steps if steps is not None else [len(o) for o in outputs]
    history = np.zeros(num_rows, np.int32)
    history[:n] = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    logprobs = np.full(num_rows, -1, np.int32)
    logprobs[:n] = [-1 if p.logprobs is None else p.logprobs for p in params]
    drafts = (
        np.full((num_rows, 0), PAD_TOKEN_ID, np.int32)
        if prior_drafts is None
        else np.asarray(prior_drafts, np.int32)
    )
    return SamplingRows(
        state=state,
        slots=jnp.asarray(slots),
        num_output_tokens=jnp.asarray(num_out),
        num_history_tokens=jnp.asarray(history),
        num_logprobs=jnp.asarray(logprobs),
        prior_drafts=jnp.asarray(drafts),
    )


def logits(num_rows, seed=0, vocab=V):
    return np.asarray(
        jax.random.normal(jax.random.PRNGKey(seed), (num_rows, vocab)) * 3, np.float32
    )
