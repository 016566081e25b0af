"""Building blocks shared by both families: RMSNorm, rotary embeddings, linear, gated MLP.

Numerics follow HF transformers: norms compute in float32; RoPE cos/sin are computed in float32
and cast to the activation dtype; matmuls run in the parameter dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import RopeScaling


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; ``unit_offset=True`` is Gemma's ``x_hat * (1 + weight)``.

    Llama style (``unit_offset=False``): normalise in float32, cast back, multiply by ``weight``
    (HF LlamaRMSNorm). Gemma style: multiply by ``1 + weight`` in float32, then cast
    (HF Gemma2RMSNorm); its weight is initialised to zeros.
    """

    def __init__(self, dim: int, *, eps: float, unit_offset: bool = False, param_dtype=jnp.float32):
        self.eps = float(eps)
        self.unit_offset = bool(unit_offset)
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype))  # [dim]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim] x.dtype
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...]
        if self.unit_offset:
            return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * normed.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies ``[D/2]`` float32 (HF default / linear / llama3 rope parameters).

    Example: head_dim 4, theta 10000 -> [1.0, 0.01].
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array,          # [..., T, H, D]
               positions: jax.Array,  # [..., T] int32
               inv_freq: np.ndarray,  # [D/2] float32
               ) -> jax.Array:        # [..., T, H, D] x.dtype
    """Rotary embedding, HF "rotate_half" layout: pairs are (i, i + D/2), not interleaved."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]              # [..., T, 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def linear(in_features: int, out_features: int, *, use_bias: bool, param_dtype,
           rngs: nnx.Rngs, std: float | None = None) -> nnx.Linear:
    """``nnx.Linear`` with kernel ``[in, out]`` ~ N(0, std^2), std = 1/sqrt(in) by default."""
    std = in_features ** -0.5 if std is None else std
    return nnx.Linear(in_features, out_features, use_bias=use_bias, param_dtype=param_dtype,
                      dtype=param_dtype, kernel_init=nnx.initializers.normal(std), rngs=rngs)


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with "silu" (Llama), GeGLU with "gelu_pytorch_tanh"."""

    def __init__(self, hidden: int, intermediate: int, *, act: str, param_dtype, rngs: nnx.Rngs):
        self.act = act
        self.gate_proj = linear(hidden, intermediate, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.up_proj = linear(hidden, intermediate, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.down_proj = linear(intermediate, hidden, use_bias=False, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., hidden] -> [..., hidden]
        return self.down_proj(_ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))
