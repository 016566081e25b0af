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

from jaxkv.models.config import RopeScaling


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
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array,  # [..., T] int32, in [0, max_positions)
    inv_freq: np.ndarray,  # [D/2] float32
    max_positions: int,
    dtype,
) -> tuple[jax.Array, jax.Array]:  # cos, sin [..., T, 1, D] dtype
    """RoPE's cos and sin by angle addition from two small tables, no transcendental at run time.

    Position p = a * B + b (B a power of two near sqrt(max_positions)):
    cos(p f) = cos(a B f) cos(b f) - sin(a B f) sin(b f), sin(p f) = sin(a B f) cos(b f) +
    cos(a B f) sin(b f), with the tables computed in float64 (so the angles are exact; HF rounds
    p * f to float32 first, a difference of at most ~6e-8 * p). Why not ``jnp.cos``: XLA fuses
    the cos into each consumer and evaluates it for every head element of q and k in every layer
    (on XLA:CPU a 2048-token tiny-llama prefill step spent 32 ms there against 385 ms in its
    matmuls; 8 layers of RoPE at 2048 tokens: 44.8 ms with ``jnp.cos``, 9.7 ms with the tables).
    Positions outside [0, max_positions) are clamped; the engine keeps positions below
    ``max_model_len <= max_position_embeddings``.

    Example: max_positions 4096 -> B = 64, tables [64, D/2] (a * B) and [64, D/2] (b).
    """
    block = 1 << max(0, math.ceil(math.log2(max(max_positions, 1)) / 2))
    rows = -(-max_positions // block)
    f = np.asarray(inv_freq, np.float64)[None, :]
    hi = (np.arange(rows, dtype=np.float64) * block)[:, None] * f  # [rows, D/2]
    lo = np.arange(block, dtype=np.float64)[:, None] * f  # [block, D/2]
    p = jnp.clip(positions.astype(jnp.int32), 0, rows * block - 1)
    a, b = p // block, p % block

    def take(table, idx):  # [n, D/2] float64 -> [..., T, D/2] float32
        return jnp.take(jnp.asarray(table.astype(np.float32)), idx, axis=0, mode="clip")

    ca, sa, cb, sb = (
        take(np.cos(hi), a),
        take(np.sin(hi), a),
        take(np.cos(lo), b),
        take(np.sin(lo), b),
    )
    cos, sin = ca * cb - sa * sb, sa * cb + ca * sb  # [..., T, D/2] float32
    cos = jnp.concatenate([cos, cos], axis=-1)[..., None, :].astype(dtype)  # [..., T, 1, D]
    sin = jnp.concatenate([sin, sin], axis=-1)[..., None, :].astype(dtype)
    return cos, sin


def apply_rope(
    x: jax.Array,  # [..., T, H, D]
    positions: jax.Array,  # [..., T] int32
    inv_freq: np.ndarray,  # [D/2] float32
    *,
    cos_sin: tuple[jax.Array, jax.Array] | None = None,  # [..., T, 1, D] each
) -> jax.Array:  # [..., T, H, D] x.dtype
    """Rotary embedding, HF "rotate_half" layout: pairs are (i, i + D/2), not interleaved.

    ``cos_sin`` (from ``rope_cos_sin``) replaces the direct ``jnp.cos`` / ``jnp.sin`` of
    ``positions * inv_freq`` (float32 angles, as HF).
    """
    if cos_sin is None:
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, D]
        cos_sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def normal_init(std: float):
    """An initializer ``(key, shape, dtype) -> N(0, std^2)`` array: ``jax.random.normal`` times
    ``std``, the values of ``nnx.initializers.normal(std)`` when run eagerly.

    The optimization barrier keeps them when the init runs inside one ``jax.jit`` (a model
    initialised straight onto a mesh, ``build_model(..., mesh=...)``): there XLA otherwise
    folds ``* std`` into the sampler's own constant multiply, and 62% of a float32 kernel's
    values came out one ulp off the eager init (measured, jax 0.10.2 CPU). Eagerly the barrier
    is an identity.
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
        x = jax.lax.optimization_barrier(jax.random.normal(key, shape, dtype))
        return x * jnp.array(std, dtype)

    return init


def linear(
    in_features: int,
    out_features: int,
    *,
    use_bias: bool,
    param_dtype,
    rngs: nnx.Rngs,
    std: float | None = None,
) -> nnx.Linear:
    """``nnx.Linear`` with kernel ``[in, out]`` ~ N(0, std^2), std = 1/sqrt(in) by default."""
    from jaxkv.models.quant import weight_dot_general

    std = in_features**-0.5 if std is None else std
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        param_dtype=param_dtype,
        dtype=param_dtype,
        kernel_init=normal_init(std),
        dot_general=weight_dot_general,  # bf16 on the CPU: the C++ kernel or f32-result dots
        rngs=rngs,
    )


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with "silu" (Llama), GeGLU with "gelu_pytorch_tanh"."""

    def __init__(self, hidden: int, intermediate: int, *, act: str, param_dtype, rngs: nnx.Rngs):
        self.act = act
        self.gate_proj = linear(
            hidden, intermediate, use_bias=False, param_dtype=param_dtype, rngs=rngs
        )
        self.up_proj = linear(
            hidden, intermediate, use_bias=False, param_dtype=param_dtype, rngs=rngs
        )
        self.down_proj = linear(
            intermediate, hidden, use_bias=False, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., hidden] -> [..., hidden]
        # Packed bf16 layers on the CPU (models.cpu_layout.AmxLinear) compute SwiGLU's hidden
        # layer in one kernel, rounded as below (None: they cannot here).
        fused = getattr(self.gate_proj, "silu_gated", None)
        if self.act == "silu" and fused is not None:
            hidden = fused(self.up_proj, x)
            if hidden is not None:
                return self.down_proj(hidden)
        return self.down_proj(gated_product(self.act, self.gate_proj(x), self.up_proj(x)))


def gated_product(act: str, gate: jax.Array, up: jax.Array) -> jax.Array:
    """``act(gate) * up`` in gate's dtype, as PyTorch's bf16 / f16 ops (HF's MLP): the
    activation and the product each computed in f32 and rounded once. jnp ops on bf16 round
    after every primitive (silu: 5 times), and XLA:CPU spent 14 ms per layer on that chain at
    2048 prefill rows ([2048, 1536] alone: 6.8 ms, 2.0 in f32)."""
    a = _ACTIVATIONS[act](gate.astype(jnp.float32)).astype(gate.dtype)
    return (a.astype(jnp.float32) * up.astype(jnp.float32)).astype(up.dtype)
