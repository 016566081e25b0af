"""The C++ weight-only quantized matmul (``cpu_backend.quantized_matmul``) against numpy on the
dequantized kernel, and where ``models.quant.quantized_matmul`` sends a matmul: the C++ kernel
for the few rows of a decode step on the CPU, XLA for more rows and on every other platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxkv.models.quant import (
    CPU_FLOAT_KERNEL_MAX_ROWS,
    CPU_KERNEL_MAX_ROWS,
    dequantize,
    quantize,
    quantized_matmul,
)
from jaxkv.pallas_kernels import cpu_backend

TARGET = cpu_backend.QMATMUL_TARGET


@pytest.fixture(autouse=True)
def _kernel():
    if jax.default_backend() != "cpu":
        pytest.skip("the C++ kernels run on the CPU platform")
    if not cpu_backend.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_backend.build_error()}")


def _case(rows, n_in, n_out, mode, block, seed=0, scale_dtype=np.float32):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    q, scale = quantize(w, mode, block, scale_dtype)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(dequantize(q, scale, np.float32), np.float64)
    return x, q, scale, want


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize(
    "rows,n_in,n_out,block",
    [
        (1, 576, 1536, None),  # SmolLM2's up projection, per channel
        (1, 1536, 576, 32),  # its down projection, GGUF Q8_0 blocks
        (3, 70, 130, None),  # inputs not a multiple of 4, a ragged last column range
        (8, 64, 200, 32),
        (64, 96, 65, None),  # the most rows the kernel takes
        (5, 256, 4097, 32),  # more columns than the widest range
        (3, 64, 4099, 32),  # two blocks for many threads: column ranges too, a ragged last one
        (2, 40, 4096, None),  # per channel: input ranges of 8 rows, one of them short
        (1, 4, 300, 2),  # blocks smaller than a pass of 8 rows
    ],
)
def test_kernel_equals_numpy_on_the_dequantized_weights(rows, n_in, n_out, block, mode):
    x, q, scale, want = _case(rows, n_in, n_out, mode, block)
    got = np.asarray(jax.jit(cpu_backend.quantized_matmul)(x, q, scale))
    assert got.shape == (rows, n_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize(
    "rows,n_in,n_out,block",
    [
        (1, 576, 4099, 32),
        (7, 96, 130, None),
        (5, 96, 70, 24),  # blocks not a multiple of 16 inputs: one weight at a time
        (3, 70, 50, None),  # inputs not a multiple of 16, per channel
    ],
)
def test_out_major_kernel_equals_numpy(rows, n_in, n_out, block, mode):
    """The LM head's layout: q [out, in] with scales [out] or [out, in // block]."""
    x, q, scale, want = _case(rows, n_in, n_out, mode, block, seed=1)
    got = np.asarray(cpu_backend.quantized_matmul(x, q.T.copy(), scale.T.copy(), out_major=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize(
    "rows,n_in,n_out,block,out_major",
    [
        (1, 576, 1536, 32, False),  # GGUF Q8_0's form: blocks of 32, float16 scales
        (3, 64, 4099, 32, False),
        (2, 96, 130, None, False),
        (1, 576, 4099, 32, True),  # the LM head's layout
        (5, 96, 70, 24, True),
        (3, 70, 50, None, True),
    ],
)
def test_float16_scales_are_read_as_stored(rows, n_in, n_out, block, out_major, mode):
    x, q, scale, want = _case(rows, n_in, n_out, mode, block, seed=2, scale_dtype=np.float16)
    assert scale.dtype == np.float16
    if out_major:
        q, scale = q.T.copy(), scale.T.copy()
    got = np.asarray(cpu_backend.quantized_matmul(x, q, scale, out_major=out_major))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "rows,n_in,n_out,out_major",
    [
        (1, 576, 1536, False),  # SmolLM2's up projection
        (3, 70, 130, False),  # inputs not a multiple of 8, a ragged last column range
        (5, 256, 4097, False),  # column ranges
        (2, 40, 4096, False),  # input ranges, one of them short
        (32, 96, 65, False),  # a decode step's most rows
        (1, 576, 4099, True),  # the tied LM head's layout [V, hidden]
        (3, 70, 50, True),  # inputs not a multiple of 16: one weight at a time
    ],
)
def test_float_weights_are_read_as_stored(rows, n_in, n_out, out_major, dtype):
    """bf16 / f32 kernels without scales: ``x @ w`` on the weights as stored (bf16 widened
    exactly), against numpy in float64 on the same numbers."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((n_in, n_out)), dtype)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    stored = w.T if out_major else w
    got = np.asarray(
        jax.jit(cpu_backend.quantized_matmul, static_argnames="out_major")(
            x, stored, None, out_major=out_major
        )
    )
    assert got.shape == (rows, n_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_float_weights_take_no_scale_and_quantized_need_one():
    x = np.ones((1, 8), np.float32)
    with pytest.raises(ValueError, match="none with a float q"):
        cpu_backend.quantized_matmul(x, jnp.ones((8, 4), jnp.bfloat16), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="a scale with an int8"):
        cpu_backend.quantized_matmul(x, np.ones((8, 4), np.int8), None)


def _lowered_linear(rows, dtype, platform):
    from flax import nnx

    from jaxkv.models.layers import linear

    layer = linear(64, 96, use_bias=True, param_dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    fn = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    x = jax.ShapeDtypeStruct((rows, 64), dtype)
    unchecked = [export.DisabledSafetyCheck.custom_call(TARGET)]
    return export.export(fn, platforms=[platform], disabled_checks=unchecked)(
        state, x
    ).mlir_module()


def test_bf16_linear_takes_the_kernel_for_decode_rows_on_cpu_only():
    """``layers.linear``'s bf16 kernel at a decode step's few rows: the C++ kernel on the CPU;
    more rows, f32 kernels and other platforms: XLA's dot."""
    assert TARGET in _lowered_linear(1, jnp.bfloat16, "cpu")
    assert TARGET in _lowered_linear(CPU_FLOAT_KERNEL_MAX_ROWS, jnp.bfloat16, "cpu")
    assert TARGET not in _lowered_linear(CPU_FLOAT_KERNEL_MAX_ROWS + 1, jnp.bfloat16, "cpu")
    assert TARGET not in _lowered_linear(1, jnp.float32, "cpu")
    for platform in ("cuda", "tpu"):
        assert TARGET not in _lowered_linear(1, jnp.bfloat16, platform)


@pytest.mark.parametrize("rows", [1, 5, CPU_FLOAT_KERNEL_MAX_ROWS + 3])
def test_bf16_linear_equals_xla_dot(rows):
    """A bf16 ``layers.linear`` (with bias) on the kernel or on XLA: the f32 product of the
    same bf16 numbers, rounded to bf16 once."""
    from flax import nnx

    from jaxkv.models.layers import linear

    layer = linear(96, 80, use_bias=True, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    layer.bias[...] = jnp.linspace(-1, 1, 80, dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((rows, 96)), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda x: layer(x))(x).astype(jnp.float32))
    w = np.asarray(layer.kernel[...].astype(jnp.float32), np.float64)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ w + np.asarray(
        layer.bias[...].astype(jnp.float32)
    )
    assert layer(x).dtype == jnp.bfloat16
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_fp8_table_matches_ml_dtypes_for_every_byte():
    """All 256 float8_e4m3fn encodings (subnormals, +-0, the NaNs) widen as ml_dtypes does."""
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).reshape(1, 256)
    got = cpu_backend.quantized_matmul(np.ones((1, 1), np.float32), codes, np.ones(256, np.float32))
    np.testing.assert_array_equal(np.asarray(got)[0], codes.astype(np.float32)[0])


def test_bad_shapes_are_refused():
    x, q, scale, _ = _case(2, 64, 32, "int8", None)
    with pytest.raises(ValueError, match="quantized_matmul takes x"):
        cpu_backend.quantized_matmul(np.zeros((65, 64), np.float32), q, scale)
    with pytest.raises(ValueError, match="quantized_matmul takes x"):
        cpu_backend.quantized_matmul(x, q.astype(np.int16), scale)


def _lowered(rows, platform):
    fn = jax.jit(lambda x, q, s: quantized_matmul(x, q, s, jnp.float32))
    args = (
        jax.ShapeDtypeStruct((rows, 64), jnp.float32),
        jax.ShapeDtypeStruct((64, 96), jnp.int8),
        jax.ShapeDtypeStruct((96,), jnp.float32),
    )
    unchecked = [export.DisabledSafetyCheck.custom_call(TARGET)]
    return export.export(fn, platforms=[platform], disabled_checks=unchecked)(*args).mlir_module()


def test_decode_rows_take_the_kernel_on_cpu_only():
    assert TARGET in _lowered(1, "cpu")
    assert TARGET in _lowered(CPU_KERNEL_MAX_ROWS, "cpu")
    assert TARGET not in _lowered(CPU_KERNEL_MAX_ROWS + 1, "cpu")
    for platform in ("cuda", "tpu"):  # lowered for another platform: XLA's dot
        assert TARGET not in _lowered(1, platform)


@pytest.mark.parametrize("block", [None, 32])
def test_model_matmul_equals_xla_path(block):
    """Through ``models.quant.quantized_matmul`` (leading dims flattened, cast to dtype): the
    kernel's rows equal XLA's for the same weights up to summation order."""
    x, q, scale, want = _case(6, 128, 96, "int8", block)
    x3 = x.reshape(2, 3, 128)
    got = np.asarray(jax.jit(lambda x, q, s: quantized_matmul(x, q, s, jnp.float32))(x3, q, scale))
    np.testing.assert_allclose(got.reshape(6, 96), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_concurrent_calls_from_several_threads_are_each_right():
    """Calls that overlap (other devices' steps, XLA's concurrent thunks) share the kernels'
    helper threads: one call holds them, the others run on XLA's pool; every result is right."""
    import concurrent.futures

    cases = [_case(1 + i % 3, 576, 1536, "int8", 32 if i % 2 else None, seed=i) for i in range(4)]
    fn = jax.jit(cpu_backend.quantized_matmul)

    def run(case):
        x, q, scale, want = case
        for _ in range(25):
            got = np.asarray(fn(x, q, scale))
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
        return True

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, cases))
