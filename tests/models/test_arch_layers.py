"""Layers: RoPE (HF rotate-half layout, llama3 scaling), RMSNorm variants, gated MLP."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import RopeScaling
from jaxkv.models.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq


def test_rope_rotate_half_layout():
    inv = rope_inv_freq(4, 10000.0, None)
    np.testing.assert_allclose(inv, [1.0, 0.01], rtol=1e-6)
    x = jnp.asarray([[[1.0, 0.0, 0.0, 0.0]]])  # [T=1, H=1, D=4]
    y = apply_rope(x, jnp.asarray([3]), inv)
    # pairs are (i, i + D/2): component 0 rotates into component 2
    np.testing.assert_allclose(y[0, 0], [math.cos(3), 0, math.sin(3), 0], atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.RandomState(0)
    inv = rope_inv_freq(16, 10000.0, None)
    q = jnp.asarray(rng.randn(1, 1, 16), jnp.float32)
    k = jnp.asarray(rng.randn(1, 1, 16), jnp.float32)

    def score(pq, pk):
        return float(
            jnp.sum(apply_rope(q, jnp.asarray([pq]), inv) * apply_rope(k, jnp.asarray([pk]), inv))
        )

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(8, 3), rel=1e-3)
    np.testing.assert_allclose(
        jnp.linalg.norm(apply_rope(q, jnp.asarray([50]), inv)), jnp.linalg.norm(q), rtol=1e-5
    )


@pytest.mark.parametrize("max_positions", [1, 5, 1000, 4096, 131072])
def test_rope_tables_match_exact_angles(max_positions):
    """rope_cos_sin (angle addition from two tables) against float64 cos/sin of p * f, at the
    ends of the range and at the block borders, for sizes that are and are not powers of two."""
    inv = rope_inv_freq(128, 500000.0, None)
    block = 1 << math.ceil(math.log2(max_positions) / 2)
    pos = np.unique(
        np.clip(
            [0, 1, block - 1, block, block + 1, max_positions // 2, max_positions - 1],
            0,
            max_positions - 1,
        )
    )
    cos, sin = rope_cos_sin(jnp.asarray(pos, jnp.int32), inv, max_positions, jnp.float32)
    assert cos.shape == sin.shape == (len(pos), 1, 128)
    angle = pos[:, None].astype(np.float64) * inv.astype(np.float64)[None, :]  # [T, 64]
    for got, want in ((cos, np.cos(angle)), (sin, np.sin(angle))):
        got = np.asarray(got)[:, 0]
        np.testing.assert_allclose(got[:, :64], want, atol=3e-7)
        np.testing.assert_array_equal(got[:, :64], got[:, 64:])  # rotate-half: halves repeat


def test_rope_tables_agree_with_direct_rope():
    """The table path and the direct float32 jnp.cos path differ only by the float32 rounding
    of p * f (HF's), which grows with p: tight at short positions, ~ulp(p * f) at long ones."""
    rng = np.random.RandomState(1)
    inv = rope_inv_freq(64, 10000.0, None)
    x = jnp.asarray(rng.randn(4096, 2, 64), jnp.float32)
    pos = jnp.arange(4096, dtype=jnp.int32)
    table = apply_rope(x, pos, inv, cos_sin=rope_cos_sin(pos, inv, 4096, jnp.float32))
    direct = apply_rope(x, pos, inv)
    diff = np.abs(np.asarray(table - direct)).max(axis=(1, 2))
    assert diff[:128].max() < 2e-5
    assert diff.max() < 2e-3
    # bf16 activations: the tables come back in the activation dtype
    c, s = rope_cos_sin(pos[:3], inv, 4096, jnp.bfloat16)
    assert c.dtype == s.dtype == jnp.bfloat16


def test_llama3_rope_scaling():
    s = RopeScaling(
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    base = rope_inv_freq(128, 500000.0, None).astype(np.float64)
    scaled = rope_inv_freq(128, 500000.0, s).astype(np.float64)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4  # short wavelengths: unchanged
    low = wavelen > 8192 / 1  # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
    smooth = (8192 / wavelen[mid] - 1.0) / (4.0 - 1.0)
    np.testing.assert_allclose(
        scaled[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid], rtol=1e-6
    )
    lin = rope_inv_freq(128, 500000.0, RopeScaling("linear", factor=2.0))
    np.testing.assert_allclose(lin, base / 2, rtol=1e-6)


def test_rms_norm_variants():
    x = jnp.asarray([[3.0, -4.0]])  # rms = sqrt(12.5)
    llama = RMSNorm(2, eps=1e-6)
    llama.weight[...] = jnp.asarray([2.0, 1.0])
    np.testing.assert_allclose(llama(x), [[2 * 3 / 12.5**0.5, -4 / 12.5**0.5]], rtol=1e-5)
    gemma = RMSNorm(2, eps=1e-6, unit_offset=True)  # weight starts at 0 -> scale 1
    np.testing.assert_allclose(gemma(x), x / 12.5**0.5, rtol=1e-5)
    gemma.weight[...] = jnp.asarray([1.0, 0.0])  # scale (1 + w)
    np.testing.assert_allclose(gemma(x), [[2 * 3 / 12.5**0.5, -4 / 12.5**0.5]], rtol=1e-5)
    assert gemma(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "act, fn",
    [
        ("silu", lambda g: g / (1 + np.exp(-g))),
        (
            "gelu_pytorch_tanh",
            lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))),
        ),
    ],
)
def test_gated_mlp(act, fn):
    mlp = GatedMLP(4, 6, act=act, param_dtype="float32", rngs=nnx.Rngs(0))
    x = np.random.RandomState(0).randn(3, 4).astype(np.float32)
    g = x @ np.asarray(mlp.gate_proj.kernel[...])
    u = x @ np.asarray(mlp.up_proj.kernel[...])
    want = (fn(g) * u) @ np.asarray(mlp.down_proj.kernel[...])
    np.testing.assert_allclose(mlp(jnp.asarray(x)), want, rtol=1e-4, atol=1e-5)
