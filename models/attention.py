"""Attention projections (q/k/v/o, optional per-head q/k norm, RoPE) and the paged attention call.

The module owns the parameters and the static per-layer facts (window, soft-cap, sm_scale);
*where* the keys come from is the caller's choice: ``paged_attend`` writes K/V into a paged
buffer and calls ``jaxkv.pallas_kernels.paged_attention``; the dense reference attends over the
whole sequence with plain jnp. Both go through the same ``project`` and ``o_proj``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxkv.models.config import KVCacheBinding, ModelConfig
from jaxkv.models.layers import RMSNorm, apply_rope, linear, rope_cos_sin, rope_inv_freq
from jaxkv.models.sharding import TP_AXIS
from jaxkv.pallas_kernels import AttentionMetadata, kv_cache_byte_view, paged_attention, write_kv
from jaxkv.pallas_kernels.layout import kv_cache_word_view


def attend_paged(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    buffer: jax.Array,  # [N * page_bytes] uint8 | [N * page_bytes / 4] uint32
    md: AttentionMetadata,  # the layer's KV-cache group
    binding: KVCacheBinding,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # o [T, Hq, D], the new buffer
    """One attention layer's paged step: write this step's K/V at ``md.slot_mapping``, then
    attend over the cache (causal within the step, plus ``sliding_window`` / ``soft_cap``).

    What a model's layer calls with ``buffer = kv_buffers[tensor]`` and ``md =
    attn_metadata[group]``, ``(group, tensor) = binding.lookup(its layer name)``; the layer
    names are those the model's ``kv_layer_infos()`` returns. Carry the returned buffer on
    (the engine donates the buffers to the step, so nothing is copied).

    The buffer's dtype is its layout (``jaxkv.worker.kv_memory``): uint8, the byte layout
    (``write_kv`` then ``paged_attention`` on the byte view, any backend); uint32, the TPU word
    layout (``write_kv_words`` then ``paged_attention_words`` on the word view: Mosaic kernels,
    backend "pallas" only; ``binding.interpret`` runs them in TPU interpret mode).

    Under tensor parallelism (``binding.mesh``) q, k and v are split by heads and the buffer
    by KV heads over the mesh's ``"tp"`` axis, and each device attends with its own heads
    over its own shard (``shard_map``; no communication: GQA groups never cross devices).
    """
    attend = functools.partial(
        _attend_local,
        binding=binding,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if binding.mesh is None:
        return attend(q, k, v, buffer, md)
    heads = PartitionSpec(None, TP_AXIS, None)
    return jax.shard_map(
        attend,
        mesh=binding.mesh,
        in_specs=(heads, heads, heads, PartitionSpec(TP_AXIS), PartitionSpec()),
        out_specs=(heads, PartitionSpec(TP_AXIS)),
        check_vma=False,
    )(q, k, v, buffer, md)


def _attend_local(q, k, v, buffer, md, *, binding, sm_scale, sliding_window, soft_cap):
    """``attend_paged`` on one device: q [T, Hq, D], k / v [T, Hkv, D], buffer its own pages."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if buffer.dtype == jnp.uint32:
        return _attend_words(
            q,
            k,
            v,
            buffer,
            md,
            binding=binding,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    buffer = write_kv(
        buffer,
        k,
        v,
        md.slot_mapping,
        block_size=binding.block_size,
        dtype=binding.cache_dtype,
        k_scale=binding.k_scale,
        v_scale=binding.v_scale,
        backend="cpu" if binding.cpu_kernels else "xla",
    )
    # The byte view (a reshape): backends bitcast only what they read, so no whole-cache
    # conversion (a full copy on XLA:CPU) ever happens.
    pages = kv_cache_byte_view(
        buffer,
        block_size=binding.block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_dim,
        dtype=binding.cache_dtype,
    )
    o = paged_attention(
        q,
        pages,
        md.seq_lens,
        md.query_start_loc,
        md.block_tables,
        md.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=binding.k_scale,
        v_scale=binding.v_scale,
        max_q_len=md.max_q_len or None,
        backend=binding.backend,
        interpret=binding.interpret,
        kv_dtype=binding.cache_dtype,
    )
    return o, buffer


def _attend_words(q, k, v, buffer, md, *, binding, sm_scale, sliding_window, soft_cap):
    """``_attend_local`` on a word-layout buffer ``[N * page_bytes / 4]`` uint32: the Mosaic
    write in place, then the Mosaic attention over the word view (a reshape, free on TPU)."""
    if binding.backend != "pallas":
        raise ValueError(
            f"a uint32 (TPU word layout) KV buffer needs backend='pallas', got {binding.backend!r}"
        )
    from jaxkv.pallas_kernels.kv_write_pallas import write_kv_words  # lazy: Pallas TPU
    from jaxkv.pallas_kernels.pallas_attention import paged_attention_words

    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    scales = dict(k_scale=binding.k_scale, v_scale=binding.v_scale)
    buffer = write_kv_words(
        buffer,
        k,
        v,
        md.slot_mapping,
        block_size=binding.block_size,
        dtype=binding.cache_dtype,
        interpret=binding.interpret,
        **scales,
    )
    words = kv_cache_word_view(
        buffer,
        block_size=binding.block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_dim,
        dtype=binding.cache_dtype,
    )
    o = paged_attention_words(
        q,
        words,
        md.seq_lens,
        md.query_start_loc,
        md.block_tables,
        md.num_seqs,
        dtype=binding.cache_dtype,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        max_q_len=md.max_q_len or None,
        interpret=binding.interpret,
        **scales,
    )
    return o, buffer


class Attention(nnx.Module):
    """GQA attention of one decoder layer (HF names: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm)."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.sliding_window = c.layer_window(layer_idx)
        self.soft_cap = c.attn_logit_softcapping
        self.sm_scale = c.sm_scale
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(c.head_dim, *c.layer_rope(layer_idx)))
        self.max_positions = c.max_position_embeddings  # RoPE tables cover [0, max_positions)
        dt = c.dtype
        h, d = c.hidden_size, c.head_dim
        self.q_proj = linear(
            h, self.num_heads * d, use_bias=c.attention_bias, param_dtype=dt, rngs=rngs
        )
        self.k_proj = linear(
            h, self.num_kv_heads * d, use_bias=c.attention_bias, param_dtype=dt, rngs=rngs
        )
        self.v_proj = linear(
            h, self.num_kv_heads * d, use_bias=c.attention_bias, param_dtype=dt, rngs=rngs
        )
        self.o_proj = linear(
            self.num_heads * d, h, use_bias=c.attention_out_bias, param_dtype=dt, rngs=rngs
        )
        if c.qk_norm:
            self.q_norm = RMSNorm(d, eps=c.rms_norm_eps, unit_offset=c.is_gemma, param_dtype=dt)
            self.k_norm = RMSNorm(d, eps=c.rms_norm_eps, unit_offset=c.is_gemma, param_dtype=dt)
        else:
            self.q_norm = self.k_norm = None

    def project(
        self,
        x: jax.Array,  # [..., T, hidden]
        positions: jax.Array,  # [..., T] int32
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [..., T, Hq, D], k/v [..., T, Hkv, D]
        """q, k, v for tokens at ``positions``: projections, q/k norm (Qwen3, Gemma 3), then RoPE."""
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = np.asarray(self.inv_freq, np.float32)  # static tuple keeps the module hashable
        cos_sin = rope_cos_sin(positions, inv_freq, self.max_positions, q.dtype)  # once for q and k
        return (
            apply_rope(q, positions, inv_freq, cos_sin=cos_sin),
            apply_rope(k, positions, inv_freq, cos_sin=cos_sin),
            v,
        )

    def output(self, o: jax.Array) -> jax.Array:  # [..., T, Hq, D] -> [..., T, hidden]
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.head_dim))

    def paged_attend(
        self,
        q: jax.Array,  # [T, Hq, D]
        k: jax.Array,  # [T, Hkv, D]
        v: jax.Array,  # [T, Hkv, D]
        buffer: jax.Array,  # this layer's KV tensor, flat uint8 | uint32
        md: AttentionMetadata,  # this layer's KV-cache group
        binding: KVCacheBinding,
    ) -> tuple[jax.Array, jax.Array]:  # o [T, Hq, D], new buffer
        """Writes this step's K/V at ``md.slot_mapping``, then attends over the paged cache."""
        return attend_paged(
            q,
            k,
            v,
            buffer,
            md,
            binding,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
        )
