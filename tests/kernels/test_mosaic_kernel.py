"""Mosaic (TPU) paged-attention kernel (mosaic_backend.py) against paged_attention_reference.

On CPU the kernel runs in TPU interpret mode (simulated DMAs, semaphores, SMEM); on a TPU it is
compiled. On a GPU only the lowering tests run (the GPU check covers the Triton kernel).
Batches come from ``make_batch``: random block-table permutations, garbage table entries past
each sequence, every page nobody may read filled with NaN.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels import pallas_attention
from jaxkv.pallas_kernels.testing import make_batch

PLATFORM = jax.default_backend()
INTERPRET = PLATFORM != "tpu"
runs_kernel = pytest.mark.skipif(PLATFORM == "gpu", reason="TPU interpret mode is checked on CPU")

CASES = {  # q_lens, kv_lens, bs, Hq, Hkv, cache dtype, q dtype, window, cap, fp8 scale, pad (S, T)
    "decode_gqa_f32": (
        [1, 1, 1, 1],
        [1, 8, 16, 13],
        8,
        4,
        1,
        "float32",
        jnp.float32,
        None,
        None,
        None,
        (5, 6),
    ),
    "decode_mha_bf16_cap": (
        [1, 1, 1],
        [16, 1, 40],
        16,
        4,
        4,
        "bfloat16",
        jnp.bfloat16,
        None,
        30.0,
        None,
        (3, 3),
    ),
    "mixed_gqa_window": (
        [1, 7, 1, 3],
        [16, 24, 1, 3],
        8,
        4,
        1,
        "float32",
        jnp.float32,
        5,
        None,
        None,
        (6, 15),
    ),
    "mixed_fp8_scales_cap": (
        [4, 1, 2],
        [32, 17, 2],
        16,
        4,
        4,
        "fp8",
        jnp.bfloat16,
        None,
        20.0,
        0.5,
        (3, 8),
    ),
    "mixed_single_head_window_cap": (
        [5, 1],
        [16, 9],
        16,
        1,
        1,
        "float32",
        jnp.float32,
        12,
        10.0,
        None,
        (2, 7),
    ),
}
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "fp8": 2e-2}


def _batch(name, seed=0):
    q_lens, kv_lens, bs, hq, hkv, cdt, qdt, window, cap, scale, (s, t) = CASES[name]
    b = make_batch(
        np.random.default_rng(seed),
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_size=bs,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_size=128,
        cache_dtype=cdt,
        q_dtype=qdt,
        num_seq_rows=s,
        num_tokens=t,
        sliding_window=window,
        kv_scale=scale,
    )
    kw = dict(sm_scale=0.09, sliding_window=window, soft_cap=cap, k_scale=scale, v_scale=scale)
    return b, kw, TOL[cdt]


@runs_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    """Small KV tiles (16 keys: 1-2 pages) so that every sequence takes several
    double-buffered DMA steps."""
    b, kw, tol = _batch(name)
    args = b.attention_args()
    want = np.asarray(pk.paged_attention_reference(*args, **kw).astype(jnp.float32))
    got = jax.jit(
        functools.partial(
            pallas_attention.paged_attention_pallas,
            lowering="mosaic",
            interpret=INTERPRET,
            max_q_len=b.max_q_len,
            kv_tile_tokens=16,
            **kw,
        )
    )(*args)
    got = np.asarray(got.astype(jnp.float32))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert (got[int(b.query_start_loc[-1]) :] == 0).all()  # padding rows


@runs_kernel
def test_public_entry_point_default_tiles():
    """pk.paged_attention(backend="pallas", lowering="mosaic") with its default KV tiles."""
    b, kw, tol = _batch("mixed_gqa_window", seed=1)
    f = jax.jit(
        functools.partial(
            pk.paged_attention,
            backend="pallas",
            lowering="mosaic",
            interpret=INTERPRET,
            max_q_len=b.max_q_len,
            **kw,
        )
    )
    got = np.asarray(f(*b.attention_args()))
    want = np.asarray(pk.paged_attention_reference(*b.attention_args(), **kw))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "case",
    [
        (16, jnp.bfloat16, jnp.bfloat16, 8, None, None, None),
        (16, jnp.float8_e4m3fn, jnp.bfloat16, 1, None, 30.0, 0.5),
        (8, jnp.float32, jnp.float32, None, 7, 50.0, None),
    ],
)
def test_lowers_to_mosaic_for_tpu(case, monkeypatch):
    """Lower (not run) for TPU on any host: lowering=None picks Mosaic there, and every op of
    the kernel has a Pallas -> Mosaic lowering (Mosaic's own compile needs a TPU)."""
    bs, cdt, qdt, mq, window, cap, scale = case
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    t, s, b, hq, hkv, d = 24, 4, 6, 8, 2, 128
    sds = jax.ShapeDtypeStruct
    args = (
        sds((t, hq, d), qdt),
        sds((3 * s * b, 2, hkv, bs, d), cdt),
        sds((s,), jnp.int32),
        sds((s + 1,), jnp.int32),
        sds((s, b), jnp.int32),
        sds((), jnp.int32),
    )
    f = jax.jit(
        functools.partial(
            pk.paged_attention,
            backend="pallas",
            sm_scale=0.1,
            max_q_len=mq,
            sliding_window=window,
            soft_cap=cap,
            k_scale=scale,
            v_scale=scale,
        )
    )
    text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "ragged_paged_attention_mosaic" in text


def test_mosaic_argument_errors():
    def batch(head_size, block_size):
        return make_batch(
            np.random.default_rng(0),
            q_lens=[1],
            kv_lens=[3],
            block_size=block_size,
            num_q_heads=4,
            num_kv_heads=2,
            head_size=head_size,
        ).attention_args()

    call = functools.partial(pk.paged_attention, sm_scale=0.1, backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="head_size to be a multiple of 128.*got 64"):
        call(*batch(64, 8), lowering="mosaic")
    with pytest.raises(ValueError, match="block_size to be a multiple of 8.*got 4"):
        call(*batch(128, 4), lowering="mosaic")
    with pytest.raises(ValueError, match="'tpu_v5'"):
        call(*batch(128, 8), lowering="tpu_v5")
    with pytest.raises(ValueError, match="backend='pallas' only"):
        pk.paged_attention(*batch(128, 8), sm_scale=0.1, backend="xla", lowering="mosaic")
    with pytest.raises(ValueError, match="kv_splits"):
        pallas_attention.paged_attention_pallas(
            *batch(128, 8), sm_scale=0.1, interpret=True, lowering="mosaic", kv_splits=2
        )
    if PLATFORM != "tpu":
        with pytest.raises(ValueError, match="lowering='mosaic' compiles for TPU.*interpret=True"):
            pk.paged_attention(*batch(128, 8), sm_scale=0.1, backend="pallas", lowering="mosaic")
