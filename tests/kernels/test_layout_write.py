"""Layout (typed view of a flat uint8 buffer) and write_kv (in-place byte scatter)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels.layout import resolve_kv_dtype

DTYPES = ["float32", "bfloat16", "float16", "fp8"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_view_is_page_major_and_pages_are_contiguous(dtype):
    bs, hkv, d, n = 8, 2, 64, 5
    pb = pk.page_bytes(bs, hkv, d, dtype)
    assert pb == 2 * bs * hkv * d * resolve_kv_dtype(dtype).itemsize
    buf = jnp.zeros(n * pb, jnp.uint8)
    # Mark page 3 with bytes 1 and check only block 3 of the view changes.
    buf = buf.at[3 * pb : 4 * pb].set(1)
    view = pk.kv_cache_view(buf, block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    assert view.shape == pk.kv_cache_shape(n, bs, hkv, d, dtype) == (n, 2, hkv, bs, d)
    assert view.dtype == resolve_kv_dtype(dtype)
    raw = np.asarray(jax.lax.bitcast_convert_type(view, jnp.uint8)).reshape(n, -1)
    assert (raw[3] == 1).all() and (np.delete(raw, 3, axis=0) == 0).all()


def test_view_accepts_jnp_dtype_and_rejects_bad_args():
    buf = jnp.zeros(4 * pk.page_bytes(8, 1, 64, jnp.bfloat16), jnp.uint8)
    assert (
        pk.kv_cache_view(buf, block_size=8, num_kv_heads=1, head_size=64, dtype=jnp.bfloat16).dtype
        == jnp.bfloat16
    )
    with pytest.raises(ValueError, match="int8"):
        pk.kv_cache_shape(4, 8, 1, 64, "int8")
    with pytest.raises(ValueError, match="block_size"):
        pk.kv_cache_shape(4, 0, 1, 64, "bfloat16")
    with pytest.raises(ValueError, match="multiple of page_bytes"):
        pk.kv_cache_view(buf[:-1], block_size=8, num_kv_heads=1, head_size=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="flat uint8"):
        pk.kv_cache_view(
            buf.astype(jnp.int8), block_size=8, num_kv_heads=1, head_size=64, dtype="bfloat16"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_lands_in_slots_and_padding_writes_nothing(dtype):
    bs, hkv, d, n = 4, 2, 64, 6
    dt = resolve_kv_dtype(dtype)
    scale = 0.5 if dtype == "fp8" else None
    pb = pk.page_bytes(bs, hkv, d, dt)
    buf = jnp.full(n * pb, 7, jnp.uint8)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    # Slot 13 = block 3 offset 1; slot 0 = block 0 offset 0; -1 twice = padding.
    slots = jnp.asarray([13, pk.PAD_SLOT_ID, 0, 22, pk.PAD_SLOT_ID], jnp.int32)
    out = jax.jit(
        functools.partial(pk.write_kv, block_size=bs, dtype=dtype, k_scale=scale, v_scale=scale)
    )(buf, k, v, slots)
    view = np.asarray(
        pk.kv_cache_view(out, block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype).astype(
            jnp.float32
        )
    )
    s = 1.0 if scale is None else scale
    tol = dict(rtol=0.07, atol=0.03) if dtype == "fp8" else dict(rtol=1e-2, atol=1e-2)
    for t, slot in ((0, 13), (2, 0), (3, 22)):
        blk, off = divmod(slot, bs)
        np.testing.assert_allclose(view[blk, 0, :, off] * s, k[t], **tol)
        np.testing.assert_allclose(view[blk, 1, :, off] * s, v[t], **tol)
    # Everything else (in particular the LAST slot, where a wrapped -1 would land) is intact.
    written = np.zeros(n * pb, bool)
    raw = np.asarray(out)
    row = d * dt.itemsize
    for slot in (13, 0, 22):
        blk, off = divmod(slot, bs)
        for c in range(2):
            for h in range(hkv):
                r = ((blk * 2 + c) * hkv + h) * bs + off
                written[r * row : (r + 1) * row] = True
    assert (raw[~written] == 7).all()
    assert (raw[-row:] == 7).all()


def test_write_kv_rejects_bad_args():
    buf = jnp.zeros(4 * pk.page_bytes(4, 2, 64, "bfloat16"), jnp.uint8)
    k = jnp.zeros((3, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(buf, k, k, jnp.zeros(4, jnp.int32), block_size=4, dtype="bfloat16")
    with pytest.raises(ValueError, match="k_scale"):
        pk.write_kv(buf, k, k, jnp.zeros(3, jnp.int32), block_size=4, dtype="bfloat16", k_scale=2.0)
    with pytest.raises(ValueError, match="page_bytes"):
        pk.write_kv(buf, k, k, jnp.zeros(3, jnp.int32), block_size=3, dtype="float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "fp8"])
def test_write_is_in_place_on_a_donated_64mib_cache(dtype):
    """The test of record: temp bytes < 2% of the cache and the cache aliased to the output."""
    bs, hkv, d, t = 16, 8, 128, 64
    dt = resolve_kv_dtype(dtype)
    pb = pk.page_bytes(bs, hkv, d, dt)
    n = (64 << 20) // pb
    scale = 0.25 if dtype == "fp8" else None

    def step(buf, k, v, slots):
        return pk.write_kv(
            buf, k, v, slots, block_size=bs, dtype=dtype, k_scale=scale, v_scale=scale
        )

    args = (
        jax.ShapeDtypeStruct((n * pb,), jnp.uint8),
        jax.ShapeDtypeStruct((t, hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((t, hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    mem = compiled.memory_analysis()
    cache_bytes = n * pb
    assert cache_bytes >= 64 << 20
    assert mem.temp_size_in_bytes < 0.02 * cache_bytes, mem
    assert mem.alias_size_in_bytes >= cache_bytes, mem
    assert mem.output_size_in_bytes - mem.alias_size_in_bytes < 0.02 * cache_bytes, mem


@pytest.mark.parametrize("dtype,max_q_len", [("bfloat16", 1), ("float32", None), ("fp8", 2)])
def test_view_write_attend_step_does_not_copy_the_cache(dtype, max_q_len):
    """A jitted write + byte view + XLA attention over a donated 64 MiB buffer: no cache-sized
    temp. This is the engine's form (models pass ``kv_cache_byte_view`` with ``kv_dtype``).

    On XLA:CPU a size-changing bitcast (uint8 -> bf16/f32) of the whole buffer is expanded into
    an elementwise pass that is materialised when read inside the attention loop, so the
    backend gathers bytes and bitcasts only the gathered chunk (see xla_backend).
    """
    bs, hkv, hq, d, s, b = 16, 4, 8, 64, 4, 64
    dt = resolve_kv_dtype(dtype)
    pb = pk.page_bytes(bs, hkv, d, dt)
    scale = 0.5 if dtype == "fp8" else None
    view = functools.partial(
        pk.kv_cache_byte_view, block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype
    )

    def step(buf, q, k, v, slots, seq_lens, qsl, tables, num_seqs):
        buf = pk.write_kv(
            buf, k, v, slots, block_size=bs, dtype=dtype, k_scale=scale, v_scale=scale
        )
        out = pk.paged_attention(
            q,
            view(buf),
            seq_lens,
            qsl,
            tables,
            num_seqs,
            sm_scale=0.125,
            k_scale=scale,
            v_scale=scale,
            max_q_len=max_q_len,
            kv_dtype=dtype,
        )
        return buf, out

    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    temps = []
    for mib in (64, 256):
        n = (mib << 20) // pb
        args = (
            sds((n * pb,), jnp.uint8),
            sds((s, hq, d), jnp.bfloat16),
            sds((s, hkv, d), jnp.bfloat16),
            sds((s, hkv, d), jnp.bfloat16),
            sds((s,), i32),
            sds((s,), i32),
            sds((s + 1,), i32),
            sds((s, b), i32),
            sds((), i32),
        )
        mem = jax.jit(step, donate_argnums=0).lower(*args).compile().memory_analysis()
        assert mem.alias_size_in_bytes >= n * pb, mem
        temps.append(mem.temp_size_in_bytes)
    # A materialised view would be >= 100% of the cache; what is there is the gathered chunk
    # (CHUNK_BYTES of bytes and its typed copies, a constant), and it does not grow with the cache.
    from jaxkv.pallas_kernels.tiles import CHUNK_BYTES

    assert temps[0] < 3 * CHUNK_BYTES < 0.25 * (64 << 20), temps
    assert abs(temps[1] - temps[0]) < 0.01 * (64 << 20), temps
