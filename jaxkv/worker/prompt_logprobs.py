"""Prompt logprobs on the worker's host side: which rows ask, the targets a step scores, and
the ``TokenLogprobs`` taken from its results (the ``prompt_logprobs[T]`` program computes them).

A row's state is the runner's ``CachedRequestState`` (``sampling_params``, ``token_ids``,
``num_prompt_tokens``, ``num_computed_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.worker.heads import prompt_row


def wants(s) -> bool:
    """The request asks for prompt logprobs and is still in its prompt."""
    return (
        getattr(s.sampling_params, "prompt_logprobs", None) is not None
        and s.num_computed_tokens < s.num_prompt_tokens
    )


def targets(states: Sequence, qsl: np.ndarray, q_lens: np.ndarray, T: int) -> np.ndarray:
    """Per token [T] int32, the next prompt token (the target of its prompt logprob) or -1."""
    out = np.full(T, -1, np.int32)
    for i, s in enumerate(states):
        if not wants(s):
            continue
        for j in range(int(q_lens[i])):
            pos = s.num_computed_tokens + j
            if pos + 1 < s.num_prompt_tokens:
                out[qsl[i] + j] = s.token_ids[pos + 1]
    return out


def collect(s, results, start: int, q_len: int, computed: int) -> list:
    """TokenLogprobs of the prompt positions computed this step (``computed`` tokens were
    cached before it; targets = next prompt token)."""
    k = s.sampling_params.prompt_logprobs
    return [
        prompt_row(results, start + j, s.token_ids[computed + j + 1], k)
        for j in range(q_len)
        if computed + j + 1 < s.num_prompt_tokens
    ]
