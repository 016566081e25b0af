"""The reference is the spec: check it against a literal numpy loop and jax's own reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels.testing import make_batch


def numpy_oracle(b, *, sm_scale, sliding_window=None, soft_cap=None):
    """One query at a time, straight from the semantics in paged_attention's docstring."""
    t_rows, hq, d = b.q.shape
    hkv = b.k_dense.shape[2]
    out = np.zeros((t_rows, hq, d), np.float32)
    q = np.asarray(b.q, np.float32)
    for i in range(int(b.num_seqs)):
        lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
        for j, row in enumerate(range(lo, hi)):
            p = b.seq_lens[i] - (hi - lo) + j
            first = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(hq):
                kh = h // (hq // hkv)
                k = b.k_dense[i, first : p + 1, kh]
                v = b.v_dense[i, first : p + 1, kh]
                s = (k @ q[row, h]) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                w = np.exp(s - s.max())
                out[row, h] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize(
    "sliding_window,soft_cap,cache_dtype",
    [(None, None, "float32"), (5, None, "float32"), (None, 3.0, "float32"), (3, 2.0, "fp8")],
)
def test_reference_matches_numpy_loop(sliding_window, soft_cap, cache_dtype):
    rng = np.random.default_rng(1)
    scale = 0.5 if cache_dtype == "fp8" else None
    b = make_batch(
        rng,
        q_lens=[3, 1, 6, 1],
        kv_lens=[11, 8, 6, 1],
        block_size=4,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=16,
        cache_dtype=cache_dtype,
        num_seq_rows=6,
        num_tokens=14,
        max_blocks=4,
        sliding_window=sliding_window,
        kv_scale=scale,
    )
    got = pk.paged_attention_reference(
        *b.attention_args(),
        sm_scale=0.3,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=scale,
        v_scale=scale,
    )
    got = np.asarray(got)
    assert not np.isnan(got).any()
    want = numpy_oracle(b, sm_scale=0.3, sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got[11:] == 0).all()  # padding rows


@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_reference_matches_jax_decode_reference(soft_cap):
    """jax's reference is decode-only and unscaled (the caller scales q) with a dense layout."""
    rng = np.random.default_rng(2)
    kv_lens = [1, 16, 23, 9]
    b = make_batch(
        rng,
        q_lens=[1] * 4,
        kv_lens=kv_lens,
        block_size=8,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=32,
        max_blocks=3,
    )
    sm_scale = 32**-0.5
    got = pk.paged_attention_reference(*b.attention_args(), sm_scale=sm_scale, soft_cap=soft_cap)
    # jax's einsums take the default precision, TF32 on a GPU (up to 9.7e-4 off on an H200);
    # ours ask for HIGHEST.
    with jax.default_matmul_precision("highest"):
        want = jax_paged.paged_attention_reference(
            jnp.asarray(b.q) * sm_scale,
            jnp.asarray(b.k_dense),
            jnp.asarray(b.v_dense),
            jnp.asarray(b.seq_lens),
            attn_logits_soft_cap=soft_cap,
        )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
