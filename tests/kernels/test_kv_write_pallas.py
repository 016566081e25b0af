"""write_kv(backend="pallas") (kv_write_pallas.py) and write_kv(backend="cpu") (the C++ FFI
write, cpu_kernels/kv_write.cc) against the XLA byte scatter, bit for bit.

On CPU both kernels run in interpret mode (Triton: Pallas' generic interpreter; Mosaic: TPU
interpret mode). On a GPU the Triton kernel is compiled (the Mosaic one is skipped), on a TPU
the Mosaic kernel. Lowering tests build the real Triton / Mosaic custom calls on any host.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.pallas_kernels as pk
from jaxkv.pallas_kernels.kv_write_pallas import write_kv_pallas
from jaxkv.pallas_kernels.layout import resolve_kv_dtype
from jaxkv.pallas_kernels.testing import abstract_gpu

PLATFORM = jax.default_backend()
NATIVE = {"gpu": "triton", "tpu": "mosaic"}.get(PLATFORM)
INTERPRET = NATIVE is None


def _lowerings():
    return [
        pytest.param(
            low,
            marks=pytest.mark.skipif(
                NATIVE not in (None, low), reason=f"{low} kernels do not run on {PLATFORM}"
            ),
        )
        for low in ("triton", "mosaic")
    ]


def _case(rng, dtype, *, num_tokens, bs=8, hkv=2, d=64, n=5):
    """Random buffer bytes, new K/V and slots: distinct real slots (incl. the first and last
    slot), PAD_SLOT_ID, another negative slot and two past the end."""
    pb = pk.page_bytes(bs, hkv, d, dtype)
    buf = jnp.asarray(rng.integers(0, 256, n * pb), jnp.uint8)
    k = jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), jnp.float32)
    special = [0, n * bs - 1, pk.PAD_SLOT_ID, -5, n * bs, n * bs + 3]
    real = rng.permutation(np.arange(1, n * bs - 1))[: num_tokens - len(special)]
    slots = jnp.asarray(rng.permutation(np.concatenate([special, real])), jnp.int32)
    return buf, k, v, slots


@pytest.mark.parametrize("lowering", _lowerings())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_equals_xla_scatter_bit_for_bit(dtype, lowering):
    scale = 0.5 if dtype == "fp8" else None
    buf, k, v, slots = _case(np.random.default_rng(1), dtype, num_tokens=21)

    def write(**kw):
        return jax.jit(
            functools.partial(
                pk.write_kv, block_size=8, dtype=dtype, k_scale=scale, v_scale=scale, **kw
            )
        )(buf, k, v, slots)

    want = np.asarray(write())
    got = np.asarray(write(backend="pallas", interpret=INTERPRET, lowering=lowering))
    np.testing.assert_array_equal(got, want)
    assert (want != np.asarray(buf)).any()


@pytest.mark.parametrize("lowering", _lowerings())
def test_token_blocks_and_padding_write_nothing(lowering):
    """Several token blocks (the last one partial); padding / out-of-range slots leave every
    byte alone, in particular the last slot's, where a wrapped -1 would land."""
    dtype, bs, hkv, d, n = "bfloat16", 8, 2, 64, 4
    rng = np.random.default_rng(2)
    buf, k, v, _ = _case(rng, dtype, num_tokens=11, bs=bs, hkv=hkv, d=d, n=n)
    slots = jnp.asarray([pk.PAD_SLOT_ID] * 5 + [n * bs, 7, 9, -2, pk.PAD_SLOT_ID, 12], jnp.int32)
    row = d * resolve_kv_dtype(dtype).itemsize
    kb = jax.lax.bitcast_convert_type(k.astype(jnp.bfloat16), jnp.uint8).reshape(11, hkv, row)
    vb = jax.lax.bitcast_convert_type(v.astype(jnp.bfloat16), jnp.uint8).reshape(11, hkv, row)
    got = np.asarray(
        jax.jit(
            functools.partial(
                write_kv_pallas,
                block_size=bs,
                interpret=INTERPRET,
                lowering=lowering,
                block_tokens=4,
            )
        )(buf, kb, vb, slots)
    )
    want = np.asarray(pk.write_kv(buf, k, v, slots, block_size=bs, dtype=dtype))
    np.testing.assert_array_equal(got, want)
    view = got.reshape(n, 2, hkv, bs, row)
    orig = np.asarray(buf).reshape(n, 2, hkv, bs, row)
    written = np.zeros((n, bs), bool)
    for slot in (7, 9, 12):
        written[slot // bs, slot % bs] = True
    keep = ~written[:, None, None, :, None].repeat(2, 1).repeat(hkv, 2).repeat(row, 4)
    assert (view[keep] == orig[keep]).all()
    assert (view[-1, :, :, -1] == orig[-1, :, :, -1]).all()


def _cpu_kernels():
    from jaxkv.pallas_kernels import cpu_backend

    if not cpu_backend.use_cpu_kernels():
        pytest.skip(f"the C++ kernels do not run here: {cpu_backend.build_error() or PLATFORM}")
    return cpu_backend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_cpu_write_equals_xla_scatter_bit_for_bit(dtype):
    """Real slots incl. the first and last, PAD_SLOT_ID, negative and past-the-end slots."""
    _cpu_kernels()
    scale = 0.5 if dtype == "fp8" else None
    buf, k, v, slots = _case(np.random.default_rng(3), dtype, num_tokens=21)

    def write(backend):
        fn = functools.partial(
            pk.write_kv, block_size=8, dtype=dtype, k_scale=scale, v_scale=scale, backend=backend
        )
        return np.asarray(jax.jit(fn)(buf, k, v, slots))

    want = write("xla")
    np.testing.assert_array_equal(write("cpu"), want)
    assert (want != np.asarray(buf)).any()


def test_cpu_write_in_place_when_donated():
    """Donated, the cache is aliased to the result (no copy in temp memory); not donated, the
    kernel copies first and the input stays as it was."""
    cpu_backend = _cpu_kernels()
    bs, hkv, d, n = 16, 2, 64, 64
    buf, k, v, slots = _case(
        np.random.default_rng(4), "float32", num_tokens=30, bs=bs, hkv=hkv, d=d, n=n
    )
    f = jax.jit(functools.partial(cpu_backend.write_rows, block_size=bs), donate_argnums=0)
    compiled = f.lower(buf, k, v, slots).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < buf.nbytes // 8
    want = np.asarray(pk.write_kv(buf, k, v, slots, block_size=bs, dtype="float32"))
    before = np.asarray(buf).copy()
    kept = jax.jit(functools.partial(cpu_backend.write_rows, block_size=bs))(buf, k, v, slots)
    np.testing.assert_array_equal(np.asarray(kept), want)
    np.testing.assert_array_equal(np.asarray(buf), before)
    np.testing.assert_array_equal(np.asarray(f(buf, k, v, slots)), want)


@pytest.mark.parametrize("lowering,platform", [("triton", "cuda"), ("mosaic", "tpu")])
def test_lowers_with_the_cache_aliased(lowering, platform, monkeypatch):
    """Builds the real custom call (no device needed): the buffer is aliased to the output."""
    monkeypatch.setattr(jax, "default_backend", lambda: {"cuda": "gpu"}.get(platform, platform))
    bs, hkv, d, t = 16, 2, 128, 24
    sds = jax.ShapeDtypeStruct
    args = (
        sds((6 * pk.page_bytes(bs, hkv, d, "bfloat16"),), jnp.uint8),
        sds((t, hkv, d), jnp.bfloat16),
        sds((t, hkv, d), jnp.bfloat16),
        sds((t,), jnp.int32),
    )
    f = jax.jit(
        functools.partial(pk.write_kv, block_size=bs, dtype="bfloat16", backend="pallas"),
        donate_argnums=0,
    )
    with abstract_gpu() if platform == "cuda" else contextlib.nullcontext():  # see abstract_gpu
        text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("triton" if lowering == "triton" else "tpu_custom_call") in text
    assert "output_operand_aliases" in text


def test_write_kv_argument_errors():
    buf, k, v, slots = _case(np.random.default_rng(0), "float32", num_tokens=8)
    kw = dict(block_size=8, dtype="float32")
    with pytest.raises(ValueError, match="'triton_gpu'"):
        pk.write_kv(buf, k, v, slots, backend="triton_gpu", **kw)
    with pytest.raises(ValueError, match="backend='pallas' only"):
        pk.write_kv(buf, k, v, slots, lowering="mosaic", **kw)
    with pytest.raises(ValueError, match="'cuda'"):
        pk.write_kv(buf, k, v, slots, backend="pallas", interpret=True, lowering="cuda", **kw)
    with pytest.raises(ValueError, match="interpret must be a bool"):
        pk.write_kv(buf, k, v, slots, backend="pallas", interpret=1, **kw)
    if INTERPRET:
        with pytest.raises(ValueError, match="interpret=True"):
            pk.write_kv(buf, k, v, slots, backend="pallas", **kw)
    pb = pk.page_bytes(8, 2, 48, "float32")  # rows of 192 bytes: not a Triton tile
    k48 = jnp.zeros((8, 2, 48), jnp.float32)
    with pytest.raises(ValueError, match="power-of-two row"):
        pk.write_kv(
            jnp.zeros(4 * pb, jnp.uint8),
            k48,
            k48,
            slots,
            backend="pallas",
            interpret=True,
            lowering="triton",
            **kw,
        )
