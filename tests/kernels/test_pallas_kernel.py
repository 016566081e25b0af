"""Pallas-kernel specifics: KV splits, tile sizes, Triton lowering checks, argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels import pallas_attention
from jaxkv.pallas_kernels.testing import abstract_gpu, make_batch

ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("kv_splits,kv_tile_tokens,block_size", [(2, 16, 8), (4, 32, 16)])
def test_kv_splits_and_small_kv_tiles(kv_splits, kv_tile_tokens, block_size):
    rng = np.random.default_rng(3)
    b = make_batch(
        rng,
        q_lens=[1, 1, 1, 6],
        kv_lens=[1, 40, 64, 50],
        block_size=block_size,
        num_q_heads=6,
        num_kv_heads=2,
        head_size=64,
        num_seq_rows=5,
        num_tokens=12,
        sliding_window=None,
    )
    args = b.attention_args()
    kw = dict(sm_scale=0.125, soft_cap=20.0)
    want = pk.paged_attention_reference(*args, **kw)
    got = jax.jit(
        functools.partial(
            pallas_attention.paged_attention_pallas,
            interpret=not ON_GPU,
            max_q_len=6,
            kv_splits=kv_splits,
            kv_tile_tokens=kv_tile_tokens,
            **kw,
        )
    )(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    assert (np.asarray(got)[9:] == 0).all()


LOWERING_CASES = [  # T, S, B, bs, Hq, Hkv, D, cache dtype, q dtype, max_q_len, window, cap, scale
    (64, 8, 16, 8, 32, 8, 128, jnp.bfloat16, jnp.bfloat16, 16, None, None, None),
    (16, 16, 8, 16, 12, 4, 64, jnp.float8_e4m3fn, jnp.bfloat16, 1, None, 30.0, 0.5),
    (33, 4, 4, 32, 24, 8, 64, jnp.float32, jnp.float32, None, 7, None, None),
    (8, 8, 4, 16, 8, 8, 128, jnp.float16, jnp.float16, 1, 4096, 50.0, None),
]


@pytest.mark.parametrize("case", LOWERING_CASES)
def test_lowers_to_triton_for_cuda(case, monkeypatch):
    """Lower (not run) for CUDA on this CPU: catches non-power-of-two tiles and ops Triton lacks."""
    t, s, b, bs, hq, hkv, d, cdt, qdt, mq, w, cap, scale = case
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
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
            sliding_window=w,
            soft_cap=cap,
            k_scale=scale,
            v_scale=scale,
        )
    )
    with abstract_gpu():  # jax >= 0.11 reads the GPU kind from a device
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_pallas_argument_errors():
    b = make_batch(
        np.random.default_rng(0),
        q_lens=[1],
        kv_lens=[3],
        block_size=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=48,
    )
    args = b.attention_args()
    with pytest.raises(ValueError, match="head_size"):
        pk.paged_attention(*args, sm_scale=0.1, backend="pallas", interpret=True)
    if not ON_GPU:
        b = make_batch(
            np.random.default_rng(0),
            q_lens=[1],
            kv_lens=[3],
            block_size=8,
            num_q_heads=4,
            num_kv_heads=2,
            head_size=64,
        )
        with pytest.raises(ValueError, match="interpret=True"):
            pk.paged_attention(*b.attention_args(), sm_scale=0.1, backend="pallas")
    with pytest.raises(ValueError, match="interpret"):
        pk.paged_attention(*args, sm_scale=0.1, backend="pallas", interpret=1)
