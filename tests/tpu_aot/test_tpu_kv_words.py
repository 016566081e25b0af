"""The TPU word layout of the KV buffer: in-place writes and zero-copy pages, every generation.

A flat uint32 buffer whose pages are TPU-packed word tiles (``layout.kv_cache_word_view``):
the KV write (``kv_write_pallas.write_kv_words``) and attention
(``pallas_attention.paged_attention_words``) give what the references give (TPU interpret mode
on CPU, no libtpu needed), and compiled for v4, v5e, v5p, v6e and v7x the write + attention
program keeps the donated buffer aliased with temp memory independent of the cache's size, for
bf16, f32 and fp8 caches. The byte layout's Mosaic write does not compile for a TPU (the
negative control: Mosaic really runs here).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import tpu_aot
from jaxkv.pallas_kernels import kv_cache_view, layout, paged_attention_reference, write_kv
from jaxkv.pallas_kernels.kv_write_pallas import write_kv_words
from jaxkv.pallas_kernels.pallas_attention import paged_attention_words
from jaxkv.pallas_kernels.testing import make_batch
from tests.tpu_aot.helpers import ALL_GENERATIONS

#: (cache dtype, block size, head size): the smallest block each packing allows; D 256 = 2 chunks.
DTYPES = [("bfloat16", 16, 256), ("float32", 8, 128), ("fp8", 32, 128)]


def scales(dtype):
    return {"k_scale": 0.5, "v_scale": 0.5} if dtype == "fp8" else {}


@pytest.mark.parametrize("dtype,bs,D", DTYPES, ids=[d[0] for d in DTYPES])
def test_word_layout_round_trips(dtype, bs, D):
    x = jax.random.normal(jax.random.key(0), (3, 2, 2, bs, D)).astype(
        layout.resolve_kv_dtype(dtype)
    )
    words = layout.typed_to_words(x)
    assert (
        words.shape == layout.kv_cache_words_shape(3, bs, 2, D, dtype) and words.dtype == jnp.uint32
    )
    np.testing.assert_array_equal(
        np.asarray(layout.words_to_typed(words, dtype).astype(jnp.float32)),
        np.asarray(x.astype(jnp.float32)),
    )
    flat = words.reshape(-1)
    assert flat.size * 4 == 3 * layout.page_bytes(bs, 2, D, dtype)
    view = layout.kv_cache_word_view(flat, block_size=bs, num_kv_heads=2, head_size=D, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(view), np.asarray(words))


def test_word_layout_rejects_unpacked_sizes():
    with pytest.raises(ValueError, match="block_size to be a multiple of 16"):
        layout.kv_cache_words_shape(4, 8, 2, 128, "bfloat16")
    with pytest.raises(ValueError, match="multiple of 32"):
        layout.check_word_layout(block_size=16, head_size=128, dtype="fp8")
    with pytest.raises(ValueError, match="head_size to be a multiple of 128"):
        layout.check_word_layout(block_size=16, head_size=64, dtype="float32")
    with pytest.raises(ValueError, match="flat uint32"):
        layout.kv_cache_word_view(
            jnp.zeros(4 * 65536, jnp.uint8),
            block_size=16,
            num_kv_heads=8,
            head_size=128,
            dtype="bfloat16",
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype,bs,D", DTYPES, ids=[d[0] for d in DTYPES])
def test_write_and_attention_match_the_references(dtype, bs, D):
    """Interpret mode: writing a step's K/V (padding slots write nothing; a prefill fills
    several rows of one tile) gives the byte layout's write's values, and attention over the
    words gives the reference's output."""
    rng = np.random.default_rng(0)
    b = make_batch(
        rng,
        q_lens=[1, 5, 20],
        kv_lens=[9, 40, 20],
        block_size=bs,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=D,
        cache_dtype=dtype,
        num_tokens=28,
        fill=0.0,
        kv_scale=0.5 if dtype == "fp8" else None,
    )
    T = b.q.shape[0]
    k = jnp.asarray(rng.standard_normal((T, 2, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, 2, D)), jnp.float32)
    slots = jnp.asarray(b.slot_mapping)
    assert int((slots < 0).sum()) == T - 26  # padding rows
    ref = kv_cache_view(
        write_kv(jnp.asarray(b.buffer), k, v, slots, block_size=bs, dtype=dtype, **scales(dtype)),
        block_size=bs,
        num_kv_heads=2,
        head_size=D,
        dtype=dtype,
    )
    words = jax.jit(
        lambda w, k, v, s: write_kv_words(
            w, k, v, s, block_size=bs, dtype=dtype, interpret=True, **scales(dtype)
        )
    )(layout.typed_to_words(jnp.asarray(b.kv_cache)).reshape(-1), k, v, slots)
    view = layout.kv_cache_word_view(words, block_size=bs, num_kv_heads=2, head_size=D, dtype=dtype)
    np.testing.assert_array_equal(
        np.asarray(layout.words_to_typed(view, dtype).astype(jnp.float32)),
        np.asarray(ref.astype(jnp.float32)),
    )
    rest = (
        jnp.asarray(b.seq_lens),
        jnp.asarray(b.query_start_loc),
        jnp.asarray(b.block_tables),
        jnp.asarray(b.num_seqs),
    )
    kw = dict(sm_scale=D**-0.5, soft_cap=30.0 if dtype == "bfloat16" else None, **scales(dtype))
    out = paged_attention_words(
        jnp.asarray(b.q), view, *rest, dtype=dtype, max_q_len=b.max_q_len, interpret=True, **kw
    )
    want = paged_attention_reference(jnp.asarray(b.q), ref, *rest, **kw)
    n = int(b.query_start_loc[int(b.num_seqs)])
    np.testing.assert_allclose(
        np.asarray(out[:n], np.float32), np.asarray(want[:n], np.float32), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("dtype,bs,D", DTYPES, ids=[d[0] for d in DTYPES])
def test_write_runs_sharing_tiles_match_the_byte_write(dtype, bs, D):
    """Interpret mode: tokens whose slots share word tiles are merged in VMEM and written back
    once per run; runs broken by padding, revisiting tiles, out of order within a tile, crossing
    a tile's edge and ending the step give the byte write's values, nothing else changes."""
    rows = 8 * layout.word_packing(dtype)  # slots one word tile holds
    num_blocks = 4
    b1 = bs  # block 1's first slot
    slots = [
        b1,
        b1 + 1,
        b1 + 2,
        -1,
        b1 + 3,
        b1 + 4,  # run, padding, the same tile again
        2 * bs + 5,
        2 * bs + 3,  # one tile, out of order
        b1 + rows - 1,
        b1 + rows,  # over a tile's edge
        3 * bs + bs - 1,
        3 * bs + bs - 2,
    ]  # the step ends inside a run
    slots = jnp.asarray(slots, jnp.int32)
    T = slots.shape[0]
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((T, 2, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, 2, D)), jnp.float32)
    start = jnp.asarray(rng.standard_normal((num_blocks, 2, 2, bs, D)), jnp.float32)
    start = start.astype(layout.resolve_kv_dtype(dtype))
    byte_buf = layout.typed_to_bytes(start).reshape(-1)
    ref = kv_cache_view(
        write_kv(byte_buf, k, v, slots, block_size=bs, dtype=dtype, **scales(dtype)),
        block_size=bs,
        num_kv_heads=2,
        head_size=D,
        dtype=dtype,
    )
    words = write_kv_words(
        layout.typed_to_words(start).reshape(-1),
        k,
        v,
        slots,
        block_size=bs,
        dtype=dtype,
        interpret=True,
        **scales(dtype),
    )
    view = layout.kv_cache_word_view(words, block_size=bs, num_kv_heads=2, head_size=D, dtype=dtype)
    got = layout.words_to_typed(view, dtype)
    np.testing.assert_array_equal(
        np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    )
    assert not np.array_equal(
        np.asarray(ref.astype(jnp.float32)), np.asarray(start.astype(jnp.float32))
    )


def compile_step(dev, dtype, bs, num_blocks, *, write_only=False):
    """write_kv_words + paged_attention_words on the donated flat word buffer (64 tokens of 8
    sequences; 32 / 8 heads of 128), compiled for ``dev``."""
    T, S, Hq, Hkv, D = 64, 8, 32, 8, 128
    words = num_blocks * layout.page_bytes(bs, Hkv, D, dtype) // 4

    def step(buf, k, v, slots, q, seq_lens, qsl, tables, num_seqs):
        buf = write_kv_words(buf, k, v, slots, block_size=bs, dtype=dtype, **scales(dtype))
        if write_only:
            return buf
        view = layout.kv_cache_word_view(
            buf, block_size=bs, num_kv_heads=Hkv, head_size=D, dtype=dtype
        )
        return paged_attention_words(
            q,
            view,
            seq_lens,
            qsl,
            tables,
            num_seqs,
            dtype=dtype,
            sm_scale=D**-0.5,
            max_q_len=T,
            **scales(dtype),
        ), buf

    sds = jax.ShapeDtypeStruct
    args = (
        sds((words,), jnp.uint32),
        sds((T, Hkv, D), jnp.bfloat16),
        sds((T, Hkv, D), jnp.bfloat16),
        sds((T,), jnp.int32),
        sds((T, Hq, D), jnp.bfloat16),
        sds((S,), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((S, 64), jnp.int32),
        sds((), jnp.int32),
    )
    return tpu_aot.aot_compile(jax.jit(step, donate_argnums=0), dev, *args), words * 4


#: CI's oldest-jax leg: bf16 on every generation; f32 and fp8 in the newest-jax leg.
ZERO_COPY_CASES = [
    pytest.param(
        g,
        dt,
        bs,
        id=f"{g}-{dt}",
        marks=[pytest.mark.tpu_aot] + ([] if dt == "bfloat16" else [pytest.mark.tpu_aot_full]),
    )
    for g in ALL_GENERATIONS
    for dt, bs in (("bfloat16", 16), ("float32", 16), ("fp8", 32))
]


@pytest.mark.parametrize("generation,dtype,bs", ZERO_COPY_CASES)
def test_word_buffer_step_is_zero_copy_on_tpu(tpu, generation, dtype, bs):
    """The flat word buffer through the TPU write and attention: aliased in place, and temp
    memory that does not grow with the cache (none on v4 / v5e / v6e / v7x with jax 0.10.2, a
    fixed 9-11 MiB on v5p) for a 4x larger cache."""
    temps, caches = [], []
    for num_blocks in (256, 1024):
        compiled, cache = compile_step(tpu(generation), dtype, bs, num_blocks)
        caches.append(cache)
        ma = compiled.memory_analysis()
        assert ma.alias_size_in_bytes >= cache, ma
        assert {re.sub(r"_m\d+_bk\d+$", "", k.name) for k in tpu_aot.mosaic_kernels(compiled)} >= {
            "ragged_paged_attention_mosaic_words",
            f"write_kv_mosaic_words_{layout.resolve_kv_dtype(dtype).name}",
        }
        temps.append(ma.temp_size_in_bytes)
    # jax 0.10.2: the same temp for both sizes; jax 0.12 (libtpu 0.0.50.1): 0.4-0.6 MiB that
    # moves by 32 KiB either way. A copy of the cache would be >= 16 MiB and grow by 3x that.
    assert max(temps) < 16 << 20 and abs(temps[1] - temps[0]) < (caches[1] - caches[0]) // 64, temps


@pytest.mark.tpu_aot
def test_byte_layout_mosaic_write_does_not_compile(tpu):
    """The negative control: the byte layout's Mosaic write DMAs one row at an offset inside a
    tiled dimension, which the TPU compiler refuses (the word layout's write exists for this)."""
    dev = tpu("v5e")
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(
        lambda buf, k, v, s: write_kv(
            buf, k, v, s, block_size=16, dtype="bfloat16", backend="pallas", lowering="mosaic"
        ),
        donate_argnums=0,
    )
    with pytest.raises(Exception, match="aligned to tiles"):
        tpu_aot.aot_compile(
            fn,
            dev,
            sds((64 * 65536,), jnp.uint8),
            sds((64, 8, 128), jnp.bfloat16),
            sds((64, 8, 128), jnp.bfloat16),
            sds((64,), jnp.int32),
        )
