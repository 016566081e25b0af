"""Pooling requests on the worker: what the host keeps of a request's prompt chunks.

A step that runs prompt tokens of pooling requests hands the host its final-normed hidden
states (the forward's ``hidden`` output, fetched only for such steps); the host adds a
request's chunks up in its ``PoolAccumulator`` and finishes the pooled vector when the prompt is
done: MEAN = sum / prompt length, CLS = the first chunk's first row, LAST = the last chunk's
last row, ALL = the rows in position order; then ``dimensions`` truncation and L2
normalisation. A pooling request that needs every token takes no prefix-cache hit, and one
that is preempted restarts from position 0, so a chunk at position 0 starts a fresh sum.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.pooling_params import PoolingParams


@dataclasses.dataclass
class PoolAccumulator:
    """One pooling request's partial result across its prompt's chunks (host side)."""

    params: PoolingParams  # resolved: task, pooling_type and normalize set
    num_prompt_tokens: int
    total: np.ndarray | None = None  # MEAN: [hidden] running sum
    first: np.ndarray | None = None  # CLS: [hidden]
    rows: np.ndarray | None = None  # ALL: [num_prompt_tokens, hidden]

    def add(self, rows: np.ndarray, computed: int) -> np.ndarray | None:
        """Takes the hidden states of the prompt positions ``computed .. computed + q_len`` a
        step ran (``rows`` [q_len, hidden] float32); returns the finished vector(s) when the
        prompt ends in this step, else None."""
        kind = self.params.pooling_type
        q_len = rows.shape[0]
        if computed == 0:  # a fresh start (first chunk, or after preemption)
            self.total = self.first = None
        if kind == "MEAN":
            part = rows.sum(axis=0, dtype=np.float32)
            self.total = part if self.total is None else self.total + part
        elif kind == "CLS" and computed == 0:
            self.first = rows[0].copy()
        elif kind == "ALL":
            if self.rows is None:
                self.rows = np.zeros((self.num_prompt_tokens, rows.shape[1]), np.float32)
            self.rows[computed : computed + q_len] = rows
        if computed + q_len < self.num_prompt_tokens:
            return None
        if kind == "MEAN":
            vec = self.total / self.num_prompt_tokens
        elif kind == "CLS":
            vec = self.first
        elif kind == "ALL":
            vec = self.rows
        else:
            vec = rows[-1].copy()
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
