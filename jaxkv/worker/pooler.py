"""Pooling requests on the worker: what a step returns for them, and what the host keeps.

A step that runs prompt tokens of pooling requests (``StepShape.pooling``) returns, besides
its samples, per row the sum, first and last of the row's final-normed hidden states in this
step (``POOL_ROWS``: three ``[S, hidden]`` float32 arrays), and with a ``token_embed`` row
among them every token's (``POOL_ALL``: ``[T, hidden]`` too). The host adds a request's
chunks up in its ``PoolAccumulator`` and finishes the pooled vector when the prompt is done:
MEAN = sum / prompt length, CLS = the first chunk's first row, LAST = the last chunk's last
row, ALL = the rows in position order; then ``dimensions`` truncation and L2 normalisation.
A pooling request that needs every token takes no prefix-cache hit, and one that is
preempted restarts from position 0, so a chunk at position 0 starts a fresh sum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pooling_params import PoolingParams

POOL_NONE, POOL_ROWS, POOL_ALL = 0, 1, 2


def pool_outputs(hidden: jax.Array,      # [T, hidden] final-normed
                 seq: jax.Array,         # [T] int32 row of each token
                 valid: jax.Array,       # [T] bool
                 qsl: jax.Array,         # [S + 1] int32
                 mode: int) -> dict[str, jax.Array]:
    """The step's pooling outputs (float32): ``pool_sum`` / ``pool_first`` / ``pool_last``
    [S, hidden], and with ``POOL_ALL`` ``pool_hidden`` [T, hidden]."""
    h = hidden.astype(jnp.float32)
    S = qsl.shape[0] - 1
    out = {"pool_sum": jax.ops.segment_sum(jnp.where(valid[:, None], h, 0.0), seq, num_segments=S),
           "pool_first": h[jnp.minimum(qsl[:-1], h.shape[0] - 1)],
           "pool_last": h[jnp.maximum(qsl[1:] - 1, 0)]}
    if mode == POOL_ALL:
        out["pool_hidden"] = h
    return out


@dataclasses.dataclass
class PoolAccumulator:
    """One pooling request's partial result across its prompt's chunks (host side)."""

    params: PoolingParams            # resolved: task, pooling_type and normalize set
    num_prompt_tokens: int
    total: np.ndarray | None = None  # MEAN: [hidden] running sum
    first: np.ndarray | None = None  # CLS: [hidden]
    rows: np.ndarray | None = None   # ALL: [num_prompt_tokens, hidden]

    def add(self, results: dict[str, np.ndarray], row: int, start: int, q_len: int,
            computed: int) -> np.ndarray | None:
        """Takes row ``row`` of a step that ran prompt positions ``computed .. computed + q_len``
        (token ``start`` of the step is the first); returns the finished vector(s) when the
        prompt ends in this step, else None."""
        kind = self.params.pooling_type
        if computed == 0:                       # a fresh start (first chunk, or after preemption)
            self.total = self.first = None
        if kind == "MEAN":
            part = results["pool_sum"][row]
            self.total = part.copy() if self.total is None else self.total + part
        elif kind == "CLS" and computed == 0:
            self.first = results["pool_first"][row].copy()
        elif kind == "ALL":
            if self.rows is None:
                self.rows = np.zeros((self.num_prompt_tokens, results["pool_hidden"].shape[1]), np.float32)
            self.rows[computed: computed + q_len] = results["pool_hidden"][start: start + q_len]
        if computed + q_len < self.num_prompt_tokens:
            return None
        if kind == "MEAN":
            vec = self.total / self.num_prompt_tokens
        elif kind == "CLS":
            vec = self.first
        elif kind == "ALL":
            vec = self.rows
        else:
            vec = results["pool_last"][row].copy()
        return finish(vec, self.params)


def finish(vec: np.ndarray, params: PoolingParams) -> np.ndarray:
    """``dimensions`` truncation then L2 normalisation (vLLM's order), over the last axis."""
    vec = np.asarray(vec, np.float32)
    if params.dimensions is not None:
        vec = vec[..., : params.dimensions]
    if params.normalize:
        norm = np.linalg.norm(vec, axis=-1, keepdims=True)
        vec = vec / np.maximum(norm, 1e-12)
    return np.ascontiguousarray(vec)
