"""Dense, non-paged forward: the spec the paged forward is tested against.

Plain jnp over whole sequences ``[Bt, L]``: causal attention with the layer's sliding window
and soft-cap, through the same parameters, projections and norms as the paged forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.models.transformer import CausalLM


def dense_attention(
    q: jax.Array,  # [Bt, L, Hq, D]
    k: jax.Array,  # [Bt, L, Hkv, D]
    v: jax.Array,  # [Bt, L, Hkv, D]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [Bt, L, Hq, D] q.dtype
    """Causal GQA attention; query p attends keys in (p - W, p] when windowed. Softmax in f32."""
    bt, length, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(bt, length, hkv, hq // hkv, d)
    logits = jnp.einsum("blkgd,bskd->bkgls", qg, k.astype(jnp.float32), precision="highest")
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    qpos = jnp.arange(length)[:, None]
    kpos = jnp.arange(length)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    logits = jnp.where(mask, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("bkgls,bskd->bkgld", p, v.astype(jnp.float32), precision="highest")
    return o.transpose(0, 3, 1, 2, 4).reshape(bt, length, hq, d).astype(q.dtype)


def dense_hidden(model: CausalLM, input_ids: jax.Array) -> jax.Array:  # [Bt, L] -> [Bt, L, hidden]
    """Final-normed hidden states of every position (positions 0..L-1 in every row)."""
    bt, length = input_ids.shape
    if length > model.config.max_position_embeddings:
        raise ValueError(
            f"length {length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (bt, length))
    h = model.embed(input_ids)
    for layer in model.model.layers:
        attn = layer.self_attn

        def attend(q, k, v, attn=attn):
            o = dense_attention(
                q,
                k,
                v,
                sm_scale=attn.sm_scale,
                sliding_window=attn.sliding_window,
                soft_cap=attn.soft_cap,
            )
            return o, None

        h, _ = layer(h, positions, attend)
    return model.model.norm(h)


def dense_forward(
    model: CausalLM, input_ids: jax.Array
) -> jax.Array:  # [Bt, L] int32 -> [Bt, L, V] f32
    """Logits of every position of every row (rows are independent; right-padding is harmless)."""
    return model.compute_logits(dense_hidden(model, input_ids))
