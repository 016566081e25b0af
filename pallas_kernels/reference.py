"""Pure-jnp paged attention reference: the spec every backend is tested against.

Written for clarity, not speed: every query token gathers its own sequence's whole block-table
row and masks it. Memory is O(T * B * bs * Hkv * D); use small shapes. The arguments are
checked eagerly; the math runs as one jit per shape (op-by-op it compiled every op anew for
each test shape: ~2.5 s a call vs ~0.35 s, same values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.pallas_kernels.metadata import NULL_BLOCK_ID
from jaxkv.pallas_kernels.validation import validate_attention_args


def token_seq_ids(
    query_start_loc: jax.Array,  # [S + 1] int32
    num_tokens: int,
) -> jax.Array:
    """Sequence index of each packed query row ([T] int32); rows past the last sequence get S.

    Example: query_start_loc = [0, 2, 5, 5] (T = 6) -> [0, 0, 1, 1, 1, 3].
    Empty (padding) sequences own no rows, so searchsorted skips them.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return (jnp.searchsorted(query_start_loc, t, side="right") - 1).astype(jnp.int32)


def paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array,  # [N, 2, Hkv, bs, D] cache dtype (kv_cache_view)
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    block_tables: jax.Array,  # [S, B] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale=None,
    v_scale=None,
) -> jax.Array:  # [T, Hq, D] q.dtype
    """Ragged paged attention, one query token at a time (see ``paged_attention`` for semantics)."""
    validate_attention_args(
        q,
        kv_cache,
        seq_lens,
        query_start_loc,
        block_tables,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return _reference(
        q,
        kv_cache,
        seq_lens,
        query_start_loc,
        block_tables,
        num_seqs,
        k_scale,
        v_scale,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def _reference(
    q,
    kv_cache,
    seq_lens,
    query_start_loc,
    block_tables,
    num_seqs,
    k_scale,
    v_scale,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:
    num_tokens, num_q_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    num_seq_rows, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    max_len = max_blocks * block_size

    seq = token_seq_ids(query_start_loc, num_tokens)  # [T]
    seq_c = jnp.clip(seq, 0, num_seq_rows - 1)
    q_len = query_start_loc[seq_c + 1] - query_start_loc[seq_c]
    valid_row = (seq < jnp.minimum(num_seqs, num_seq_rows)) & (
        jnp.arange(num_tokens) < query_start_loc[-1]
    )
    pos = seq_lens[seq_c] - q_len + (jnp.arange(num_tokens) - query_start_loc[seq_c])  # [T]

    key_pos = jnp.arange(max_len, dtype=jnp.int32)  # [L]
    mask = valid_row[:, None] & (key_pos[None, :] <= pos[:, None])  # [T, L]
    if sliding_window is not None:
        mask &= key_pos[None, :] > pos[:, None] - sliding_window
    # Blocks nobody needs may hold garbage ids: read the null block there instead (values masked).
    needed = (jnp.arange(max_blocks)[None, :] * block_size) < seq_lens[:, None]
    tables = jnp.where(needed, block_tables, NULL_BLOCK_ID)
    pages = kv_cache[tables[seq_c]]  # [T, B, 2, Hkv, bs, D]
    pages = pages.astype(jnp.float32).transpose(0, 2, 3, 1, 4, 5)  # [T, 2, Hkv, B, bs, D]
    pages = pages.reshape(num_tokens, 2, num_kv_heads, max_len, head_size)
    k, v = pages[:, 0], pages[:, 1]  # [T, Hkv, L, D]
    if k_scale is not None:
        k = k * jnp.asarray(k_scale, jnp.float32)
    if v_scale is not None:
        v = v * jnp.asarray(v_scale, jnp.float32)
    # Masked keys may be NaN (unused pages): zero them so 0 * NaN cannot leak into the output.
    v = jnp.where(mask[:, None, :, None], v, 0.0)

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_size)
    logits = jnp.einsum("tkgd,tksd->tkgs", qg, k, precision="highest") * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    m = mask[:, None, None, :]
    logits = jnp.where(m, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(m, jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tkgs,tksd->tkgd", p, v, precision="highest")
    out = out / jnp.where(denom > 0, denom, 1.0)  # fully masked -> 0
    return out.reshape(num_tokens, num_q_heads, head_size).astype(q.dtype)
