"""The KV cache stays in place and the kernels fit an NVIDIA H200, deviceless (jaxkv.gpu_aot).

Here: the test of record and the kernels at realistic shapes (test_h200_steps.py: every
program). The forwards run the Pallas Triton kernels (``attention_backend="pallas"``, not
interpreted) and are compiled to sm_90a machine code on this CPU-only machine, for tiny-llama
and tiny-hybrid (sliding windows, soft-caps); the KV buffers stay aliased in place and temp
memory does not grow with the cache (the test of record, on the GPU executable); the kernels
at Llama-3-8B-like and Gemma-2-like shapes (bf16 and fp8 caches) use no more shared memory
than a block may have and spill no register; a Llama-3-8B-sized layer compiles in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxkv.pallas_kernels as pk
from jaxkv import gpu_aot
from tests.engine.helpers import llama3_8b_layer, llama3_8b_layer_runner
from tests.gpu_aot.helpers import compile_forward, pallas_runner

pytestmark = pytest.mark.gpu_aot


#: (family, cache dtype, decode): every cache dtype's view in the forward of a mixed step
#: (decode and prefill tiles, KV writes); the forward of a 4-token decode in bf16, the GPU's
#: cache dtype. (test_h200_steps.py checks aliasing at every decode shape.)
#: CI's oldest-jax leg runs the bf16 cases; the f32 and fp8 views are gpu_aot_full (newest jax).
IN_PLACE_CASES = [
    pytest.param(
        f,
        dt,
        d,
        id=f"{f}-{dt}-{'decode' if d else 'mixed'}",
        marks=[] if dt == "bfloat16" else [pytest.mark.gpu_aot_full],
    )
    for f in ("tiny-llama", "tiny-hybrid")
    for dt, d in (("bfloat16", True), ("bfloat16", False), ("auto", False), ("fp8", False))
]


@pytest.mark.parametrize("family,cache_dtype,decode", IN_PLACE_CASES)
def test_step_updates_cache_in_place_on_h200(h200, family, cache_dtype, decode):
    """The test of record (tests/engine/test_step_memory.py) on the GPU executable."""
    temps = []
    for mib in (16, 64):
        runner = pallas_runner(family, kv_cache_memory_bytes=mib << 20, kv_cache_dtype=cache_dtype)
        cache = sum(b.nbytes for b in runner.buffers)
        ma = compile_forward(runner, h200, 4 if decode else 64).memory_analysis()
        assert ma.alias_size_in_bytes >= cache  # buffers donated and aliased, not copied
        assert ma.temp_size_in_bytes < 0.25 * cache or mib == 16
        temps.append(ma.temp_size_in_bytes)
    assert temps[0] == temps[1], temps  # the same program apart from the cache's size


#: (name, Hq, Hkv, D, window, soft_cap, cache dtype): Llama-3-8B-like and Gemma-2-9B-like.
KERNEL_SHAPES = [
    ("llama3-8b", 32, 8, 128, None, None, "bfloat16"),
    ("llama3-8b-fp8", 32, 8, 128, None, None, "fp8"),
    ("gemma2-9b-local", 16, 8, 256, 4096, 50.0, "bfloat16"),
]


def kernel_launches(dev, Hq, Hkv, D, window, soft_cap, cache_dtype, *, decode: bool):
    """The Triton kernels of one paged-attention call: 64 sequences of 4k context, either
    all decoding or 4 prefill chunks of 512 tokens among 60 decodes; block size 16."""
    bs, S, ctx = 16, 64, 4096
    T = S if decode else 4 * 512 + 60
    blocks = ctx // bs
    dt = pk.resolve_kv_dtype(cache_dtype)
    args = (
        jax.ShapeDtypeStruct((T, Hq, D), jnp.bfloat16),
        jax.ShapeDtypeStruct(pk.kv_cache_shape(1 + S * blocks, bs, Hkv, D, dt), dt),
        jax.ShapeDtypeStruct((S,), jnp.int32),
        jax.ShapeDtypeStruct((S + 1,), jnp.int32),
        jax.ShapeDtypeStruct((S, blocks), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    scales = {"k_scale": 0.5, "v_scale": 0.5} if cache_dtype == "fp8" else {}
    fn = jax.jit(
        lambda *a: pk.paged_attention(
            *a,
            sm_scale=D**-0.5,
            sliding_window=window,
            soft_cap=soft_cap,
            backend="pallas",
            max_q_len=1 if decode else 512,
            **scales,
        )
    )
    _, launches = gpu_aot.compile_with_report(fn, dev, *args)
    return launches


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "mixed"])
@pytest.mark.parametrize("case", KERNEL_SHAPES, ids=[c[0] for c in KERNEL_SHAPES])
def test_kernels_fit_the_h200(h200, case, decode):
    launches = kernel_launches(h200, *case[1:], decode=decode)
    assert launches, "no Triton kernel"
    limit = gpu_aot.shared_memory_limit("h200")
    for k in launches:
        assert 0 < k.shared_mem_bytes <= limit, k
        assert k.spill_bytes == 0, k  # ptxas -v: no spill stores or loads
        assert k.registers is not None and k.registers <= 255, k


def test_llama3_8b_layer_compiles_in_bf16(h200):
    """One Llama-3-8B-sized layer (hidden 4096, MLP 14336, 32 / 8 heads of 128, vocabulary
    128256) in bf16, weights abstract (nothing is allocated): decode and mixed steps."""
    runner = llama3_8b_layer_runner(llama3_8b_layer())
    for T in (64, 512):
        compiled = compile_forward(runner, h200, T)
        assert compiled.memory_analysis().temp_size_in_bytes < 1 << 30
